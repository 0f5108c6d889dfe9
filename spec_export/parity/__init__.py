"""How an exported graph is checked against the PyTorch model it came from: the thresholds and
prompts (quality); the parity runs, one entry point for a decoder graph and an encoder-decoder's
two (check) over what every run shares (calls); a quantized graph against the float model
(quantized); a lanes graph against its decoder graph (lanes_parity); and `specexport verify`
(verify), which runs them again on a built bundle."""
