"""The dim orders of the Gluon page scorers' A tiles (``triton.decode.fragments.phys_dim``,
``triton.decode.wgflat.phys_dim_e4m3``): permutations of the 128 dims, consistent with the
lookup's output placement (``lut.PAIR_NIBBLES``)."""

from __future__ import annotations

from nvfp4_indexer.triton.decode.fragments import phys_dim


def test_phys_dim_e4m3_is_a_permutation():
    """The E4M3 A tile's column -> dim map (``wgflat.phys_dim_e4m3``) is a permutation
    of the 128 dims, and column c of K half g' reads a dim of group 2j + g' (j = the lane's
    group pair, as the code-load layout ``CL`` gives each lane its groups 2j, 2j + 1)."""
    from nvfp4_indexer.triton.decode.wgflat import phys_dim_e4m3
    dims = [phys_dim_e4m3(c) for c in range(128)]
    assert sorted(dims) == list(range(128))
    for c in range(128):
        assert dims[c] // 16 == 2 * ((c >> 2) & 3) + (c >> 6)


def test_phys_dim_is_a_permutation():
    assert sorted(phys_dim(c) for c in range(128)) == list(range(128))
