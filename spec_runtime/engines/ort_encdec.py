"""ONNX Runtime engine for an encoder-decoder bundle: the encoder graph once per request, then
the decoder graph exactly as OrtEngine drives a decoder-only one.

The encoder reads the source right-padded to the static max_source_len (or, for speech, one
log-mel window: spec_runtime/audio.py) and returns the cross-attention K/V of every decoder layer, on the engine's device; they and the source mask are
bound once per request as inputs of every decoder call of that request (no copy per step). The
host inputs are bound after their values are written, each request: ONNX Runtime copies an
input to the device that reads it when it is bound. `reset()` (called by the decode loop after
`encode_source`) keeps them: only the self-attention cache is per-position, and positions make
its stale slots invisible.
"""

from __future__ import annotations

import time

import numpy as np

from ..bundle.contract import FEATURES
from ..errors import CacheCapacityError, InputError
from .devices import DEVICES, Device
from ..bundle.manifest import GraphEntry
from .ort import OrtEngine, open_session


class OrtEncDecEngine(OrtEngine):
    """spec_runtime.engines.protocol.Engine plus `encode_source(source_ids)`, over an encoder and a
    decoder graph (checked against the contract: the encoder's outputs are the decoder's cross
    inputs, its source length max_source_len)."""

    def __init__(self, session, graph: GraphEntry, encoder, encoder_graph: GraphEntry, *,
                 vocab_size: int, max_len: int, max_source_len: int, prefill_chunk: int,
                 device: Device = DEVICES["cpu"], store=None):
        super().__init__(session, graph, vocab_size=vocab_size, max_len=max_len,
                         prefill_chunk=prefill_chunk, device=device, store=store)
        self.encoder = encoder
        self.encoder_graph = encoder_graph
        self.max_source_len = max_source_len
        self.cross_names = [o["name"] for o in encoder_graph.outputs]
        features = next((i for i in encoder_graph.inputs if i["name"] == FEATURES), None)
        # a speech encoder's input: [1, n_mels, frames]; None for a token source
        self.features_shape = tuple(features["shape"]) if features else None
        self._source = np.zeros(self.features_shape or (1, max_source_len),
                                dtype=np.float32 if features else np.int64)
        self._source_mask = np.zeros((1, max_source_len), dtype=np.int64)
        self._encoder_binding = encoder.io_binding()
        for name in self.cross_names:
            self._encoder_binding.bind_output(name, self.device.memory, self.device.device_id)
        self.cross: dict = {}  # this request's cross K/V (OrtValues), bound as decoder inputs
        self.encoded = False
        self.encode_seconds = 0.0  # what the last encode_source took

    @classmethod
    def open(cls, decoder_path, graph: GraphEntry, encoder_path, encoder_graph: GraphEntry, *,
             vocab_size: int, max_len: int, max_source_len: int, prefill_chunk: int,
             device: Device = DEVICES["cpu"], threads: int | None = None, spinning: bool = True,
             where: str = "graph", metadata: dict | None = None,
             encoder_metadata: dict | None = None, provider_options: dict | None = None,
             encoder_provider_options: dict | None = None) -> "OrtEncDecEngine":
        """`provider_options` for the decoder's session, `encoder_provider_options` for the
        encoder's (a TensorRT profile is the graph's own: ort_engine.provider_options)."""
        common = dict(device=device, threads=threads, spinning=spinning)
        session = open_session(decoder_path, graph, where=f"{where}.graphs.decoder",
                               metadata=metadata, provider_options=provider_options, **common)
        encoder = open_session(encoder_path, encoder_graph, where=f"{where}.graphs.encoder",
                               metadata=encoder_metadata,
                               provider_options=encoder_provider_options, **common)
        return cls(session, graph, encoder, encoder_graph, vocab_size=vocab_size,
                   max_len=max_len, max_source_len=max_source_len, prefill_chunk=prefill_chunk,
                   device=device)

    def fork(self) -> "OrtEncDecEngine":
        return self._same_form(type(self)(
            self.session, self.graph, self.encoder, self.encoder_graph,
            vocab_size=self.vocab_size, max_len=self.max_len,
            max_source_len=self.max_source_len, prefill_chunk=self.prefill_chunk,
            device=self.device, store=self._store))

    def check_source(self, n: int) -> None:
        """CacheCapacityError unless a source of n tokens fits the encoder."""
        if n > self.max_source_len:
            raise CacheCapacityError(
                f"the source has {n} tokens but the bundle's max_source_len is "
                f"{self.max_source_len}: shorten it, or re-export with `specexport build "
                f"--max-source-len {n}` (or more)"
            )
        if n == 0:
            raise InputError("the source is empty: give at least one token")

    @property
    def audio(self) -> bool:
        return self.features_shape is not None

    def example_source(self, rng: np.random.Generator) -> np.ndarray:
        """A source this engine encodes, for measurements: 8 token ids (fewer where the encoder
        reads fewer), or a window of features in the range log_mel gives."""
        if self.audio:
            return rng.uniform(-1.0, 1.5, self.features_shape[1:]).astype(np.float32)
        return rng.integers(0, self.vocab_size, min(8, self.max_source_len))

    def encode_source(self, source) -> None:
        """Run the encoder on one request's source: its token ids, or a speech encoder's
        features [n_mels, frames] (audio.log_mel); its cross K/V serve every forward until the
        next encode_source."""
        t0 = time.perf_counter()
        self.encoded = False  # until the encoder has run on what _source now holds
        if self.audio:
            self._encode_features(source)
        else:
            self._encode_ids(source)
        self.encoder.run_with_iobinding(self._encoder_binding)
        self.cross = dict(zip(self.cross_names, self._encoder_binding.get_outputs()))
        for name, value in self.cross.items():
            self._binding.bind_ortvalue_input(name, value)
        self.encoded = True
        self.encode_seconds = time.perf_counter() - t0

    def holds(self, source) -> bool:
        """Whether the cross K/V bound now are this engine's encoding of `source`: the source
        it last encoded, compared by value (a caller may fill one array again and again)."""
        if not self.encoded:
            return False
        if self.audio:
            x = np.asarray(source, dtype=np.float32)
            return x.size == self._source.size and np.array_equal(
                x.reshape(self._source.shape[1:]), self._source[0])
        ids = np.asarray(source, dtype=np.int64).reshape(-1)
        return len(ids) == int(self._source_mask.sum()) and \
            np.array_equal(self._source[0, :len(ids)], ids)

    @property
    def source_mask(self) -> np.ndarray:
        """[1, max_source_len]: this request's source positions (1) and padding (0)."""
        return self._source_mask

    def use_encoding_of(self, other: "OrtEncDecEngine") -> None:
        """Read `other`'s encoding of its source, as if this engine had encoded it (nothing is
        copied but the mask, and the source, which `holds` reads): engines checked over one
        source (lanes.check_lanes)."""
        self._source_mask[:] = other._source_mask
        self._source[:] = other._source
        if not self.audio:
            self._binding.bind_cpu_input("source_mask", self._source_mask)
        self.cross = other.cross
        for name, value in self.cross.items():
            self._binding.bind_ortvalue_input(name, value)
        self.encoded = True

    def _encode_ids(self, source_ids) -> None:
        ids = np.asarray(source_ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        self.check_source(n)
        self._source[:] = 0  # padding id is irrelevant: the mask hides it
        self._source[0, :n] = ids
        self._source_mask[:] = 0
        self._source_mask[0, :n] = 1
        self._encoder_binding.bind_cpu_input("input_ids", self._source)
        self._encoder_binding.bind_cpu_input("attention_mask", self._source_mask)
        self._binding.bind_cpu_input("source_mask", self._source_mask)

    def _encode_features(self, features) -> None:
        x = np.asarray(features, dtype=np.float32)
        want = self.features_shape[1:]
        if x.shape not in (want, (1, *want)):
            raise InputError(f"the features have shape {list(x.shape)}; this bundle's encoder "
                             f"reads {list(want)} (n_mels, frames): make them with "
                             f"spec_runtime.audio.log_mel(samples, n_mels={want[0]}, "
                             f"frames={want[1]})")
        if not np.isfinite(x).all():
            raise InputError("the features hold NaN or infinite values: make them with "
                             "spec_runtime.audio.log_mel")
        self._source[0] = x.reshape(want)
        self._encoder_binding.bind_cpu_input(FEATURES, self._source)

    def forward(self, tokens: np.ndarray, pos: int, num_logits: int = 1) -> np.ndarray:
        if not self.encoded:
            raise RuntimeError("OrtEncDecEngine.forward before encode_source(): encode the "
                               "source first")
        return super().forward(tokens, pos, num_logits)


class SharedEncoderEngine(OrtEngine):
    """An encoder-decoder draft that has a decoder only (the manifest's draft.shared_encoder):
    it reads its target's cross-attention K/V (and source mask), bound once per request by
    `use_encoding(target)` after the target encoded the source: a self draft's encoder would
    compute what the target's computes, so the request runs one encoder, not two."""

    shares_encoder = True

    def __init__(self, session, graph: GraphEntry, *, vocab_size: int, max_len: int,
                 prefill_chunk: int, device: Device = DEVICES["cpu"], store=None):
        super().__init__(session, graph, vocab_size=vocab_size, max_len=max_len,
                         prefill_chunk=prefill_chunk, device=device, store=store)
        self.cross_names = [i["name"] for i in graph.inputs if i["name"].startswith("cross_")]
        self.masked = any(i["name"] == "source_mask" for i in graph.inputs)
        self.encoded = False

    def fork(self) -> "SharedEncoderEngine":
        return self._same_form(type(self)(
            self.session, self.graph, vocab_size=self.vocab_size, max_len=self.max_len,
            prefill_chunk=self.prefill_chunk, device=self.device, store=self._store))

    def use_encoding(self, target: OrtEncDecEngine) -> None:
        """Read `target`'s encoding of this request's source in every forward until the next
        call."""
        for name in self.cross_names:
            self._binding.bind_ortvalue_input(name, target.cross[name])
        if self.masked:
            self._binding.bind_cpu_input("source_mask", target._source_mask)
        self.encoded = True

    def forward(self, tokens: np.ndarray, pos: int, num_logits: int = 1) -> np.ndarray:
        if not self.encoded:
            raise RuntimeError("SharedEncoderEngine.forward before use_encoding(): the target "
                               "encodes the source first")
        return super().forward(tokens, pos, num_logits)


def encode_drafts(target: OrtEncDecEngine, engines, source) -> None:
    """After `target` encoded a request's source: each draft engine encodes it too, or reads
    the target's encoding (SharedEncoderEngine)."""
    for engine in engines:
        if getattr(engine, "shares_encoder", False):
            engine.use_encoding(target)
        else:
            engine.encode_source(source)
