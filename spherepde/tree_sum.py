"""Tree (pruned) attention sums; the code lives in spherepde.summation.tree."""

from .summation.tree import LEAF_SIZE, SourceTree, tree_softmax

__all__ = ["SourceTree", "tree_softmax", "LEAF_SIZE"]
