"""Facts about torch's objects that every wing reads the same way: a tensor's identity (its
storage, its version counter, its size in bytes) and the unit sizes are reported in
(``tensors``); what aten operators are (``operators``: the products a selective checkpoint
keeps, the norms). The floor below every other package: it imports nothing of revnets."""

from revnets.facts.tensors import MiB, nbytes, storage_key, storage_uses, version_of

__all__ = ["MiB", "nbytes", "storage_key", "storage_uses", "version_of"]
