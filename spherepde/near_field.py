"""Near-field corrections of the attention sums; the code lives in spherepde.summation.near_field."""

from .summation.near_field import (NearField, cell_kernel_integral, near_field_table, near_rings, table_bytes,
                                   tensor_rule)

__all__ = ["NearField", "near_field_table", "near_rings", "table_bytes", "cell_kernel_integral", "tensor_rule"]
