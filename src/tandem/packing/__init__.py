"""Tree packing: rows as prefix tries (trie.py), tree attention (tree_attention.py), chunked log-probs (log_probs.py)."""

from tandem.packing.trie import LAYOUTS, PADDED, TREE, PackedRow, TrieRow, pack

__all__ = ["LAYOUTS", "PADDED", "TREE", "PackedRow", "TrieRow", "pack"]
