import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.slurm.hostlist import HostlistError, compress, expand


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("c1", ["c1"]),
        ("c[1-3]", ["c1", "c2", "c3"]),
        ("c[1-2,5],d7", ["c1", "c2", "c5", "d7"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("", []),
    ],
)
def test_expand(expr: str, names: list[str]) -> None:
    assert expand(expr) == names


@pytest.mark.parametrize("bad", ["c[1-", "c]1[", "c[a-b]", "c[5-1]", "c[1-99999999]"])
def test_expand_rejects_malformed_lists_with_a_clear_error(bad: str) -> None:
    with pytest.raises(HostlistError, match="hostlist|range"):
        expand(bad)


def test_compress_groups_runs_and_keeps_padding() -> None:
    assert compress(["c1", "c2", "c3", "c7"]) == "c[1-3,7]"
    assert compress(["gpu08", "gpu09", "gpu10"]) == "gpu[08-10]"
    assert compress(["login"]) == "login"
    assert compress(["c5"]) == "c5"


@given(st.sets(st.integers(min_value=0, max_value=5000), min_size=1, max_size=200))
def test_compress_then_expand_round_trips(nums: set[int]) -> None:
    names = [f"n{i}" for i in sorted(nums)]
    assert expand(compress(names)) == names
