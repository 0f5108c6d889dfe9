"""The bundle: the one contract between exporter and runtime.

    contract.py    what the graphs' inputs and outputs are, named once for both sides
    manifest.py    manifest.json, typed and versioned: one writer (spec_export), one reader
    checks.py      what a manifest must say, and the files it names (hashes, regular files)
    onnx_refs.py   the external-data files a graph names, read without loading it
    reader.py      where bundles are; a bundle's manifest and tokenizer, read and checked

The layer just above errors: nothing here imports the engines, the decoding or the model;
loading.py (spec_runtime.load) wires a bundle into a Generator.
"""
