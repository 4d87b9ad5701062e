"""``labkit cluster`` refuses bad input by name before starting anything."""

import pytest

from labkit.cli import main
from labkit.router.cluster import Cluster


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit) as e:
        main(["cluster", "up", "0"])
    assert e.value.code == 2 and "N must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["cluster", "up", "2", "--policy", "random"])
    with pytest.raises(ValueError, match="at least one replica"):
        Cluster(0)
    with pytest.raises(ValueError, match="unknown routing policy"):
        Cluster(2, policy="fastest")
