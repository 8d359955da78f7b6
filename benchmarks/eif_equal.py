"""Are two .eif files the same weights? Tensor by tensor: packed codes, scales and zero
points of quantized tensors, values of float ones.

usage:
  python benchmarks/eif_equal.py A.eif B.eif

Prints the tensor count and, per differing tensor, the fraction of its codes that differ;
exit status 0 when every tensor is bit-identical, 1 otherwise. Used to check that a
converter speed-up leaves its output unchanged.
"""
from __future__ import annotations

import sys

import numpy as np


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    from edgeinfer.backends.quantized import QuantizedTensor
    from edgeinfer.container import read_eif

    a, b = read_eif(argv[0]).tensors, read_eif(argv[1]).tensors
    if sorted(a) != sorted(b):
        print(f"different tensor names: {sorted(set(a) ^ set(b))[:10]}")
        return 1
    diff = []
    for k in sorted(a):
        x, y = a[k], b[k]
        if isinstance(x, QuantizedTensor) != isinstance(y, QuantizedTensor):
            diff.append((k, "kind"))
        elif isinstance(x, QuantizedTensor):
            same = (x.qweight.shape == y.qweight.shape and np.array_equal(x.qweight, y.qweight)
                    and np.array_equal(x.scales, y.scales)
                    and (x.zeros is None) == (y.zeros is None)
                    and (x.zeros is None or np.array_equal(x.zeros, y.zeros)))
            if not same:
                f = (float((x.codes() != y.codes()).mean()) if x.qweight.shape == y.qweight.shape
                     else 1.0)
                diff.append((k, f"{f:.4f} of codes"))
        elif not np.array_equal(np.asarray(x), np.asarray(y)):
            diff.append((k, "values"))
    print(f"{len(a)} tensors, {len(diff)} differ")
    for k, what in diff:
        print(f"  {k}: {what}")
    return 0 if not diff else 1


if __name__ == "__main__":
    raise SystemExit(main())
