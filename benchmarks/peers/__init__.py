"""Peers that maxnnx's training throughput is compared against: a plain PyTorch Llama and MaxText.

Each peer has a launcher module (run with the project's Python; it imports neither torch nor
MaxText) that builds the peer's own virtual environment once and runs an inner script there.
"""
