"""How an exported graph is checked against the PyTorch model it came from: the thresholds and
prompts (quality), the parity runs, a lanes graph against its decoder graph (lanes_parity), and
`specexport verify` (verify), which runs them again on a built bundle."""
