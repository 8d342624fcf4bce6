"""Facts about torch's objects that every wing reads the same way: a tensor's identity (its
storage, its version counter, its device, its size in bytes) and the unit sizes are reported in
(``tensors``); what aten operators are (``operators``: the products a selective checkpoint
keeps, the norms, their floating-point operations). The floor below every other package: it
imports nothing of revnets."""

from revnets.facts.tensors import MiB, device_of, nbytes, storage_key, storage_uses, version_of

__all__ = ["MiB", "device_of", "nbytes", "storage_key", "storage_uses", "version_of"]
