"""colonnade: decentralized RL post-training over an object store."""

__version__ = "0.1.0"
