from pathlib import Path

import pytest

from gpuwarden import config
from gpuwarden.core.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "gpuwarden.toml"
    p.write_text(text)
    return p


def test_missing_default_file_means_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(config.ENV_VAR, raising=False)
    monkeypatch.setattr(config, "DEFAULT_PATH", tmp_path / "absent.toml")
    assert config.load() == config.Config()


def test_env_var_points_elsewhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    p = write(tmp_path, "[slurm]\nretries = 5\n")
    monkeypatch.setenv(config.ENV_VAR, str(p))
    assert config.load().slurm.retries == 5


def test_explicitly_named_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        config.load(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ("[slurm]\nretrys = 3\n", "slurm.retrys", "unknown key"),
        ("[slurm]\nretries = '3'\n", "slurm.retries", "an integer"),
        ("[slurm]\nretries = true\n", "slurm.retries", "an integer"),
        ("[slurm]\nretries = 99\n", "slurm.retries", "from 0 to 10"),
        ("[slurm]\nbin_dir = 'usr/bin'\n", "slurm.bin_dir", "absolute"),
        ("[slurm]\nbackend = 'pyslurm'\n", "slurm.backend", "cli"),
        ("[cluster]\nnodes = 0\n", "cluster.nodes", "from 1"),
        ("[cluster]\nname = 'bad name!'\n", "cluster.name", "letters"),
        ("slurm = 3\n", "slurm", "a table"),
        ("[surlm]\n", "surlm", "unknown key"),
        ("[logging]\nlevel = 'LOUD'\n", "logging.level", "one of"),
        ("[health]\ngpu_probe = 'dcgm'\n", "health.gpu_probe", "nvml"),
        ("[health]\ndrian = true\n", "health.drian", "unknown key"),
        ("[health.expected]\nmounts = [{path = 'fsx'}]\n", "health.expected.mounts[0].path",
         "absolute"),
        ("[health.expected]\nmounts = [{path = '/fsx', canary = '../../etc/shadow'}]\n",
         "health.expected.mounts[0].canary", "without '..'"),
        ("[health.expected]\nib_ports = ['mlx5_0']\n", "health.expected.ib_ports", "device:port"),
        ("[health.blast_radius]\nmax_drained_pct = 150\n", "health.blast_radius.max_drained_pct",
         "percentage"),
        ("[health.classes.a]\nnodes = 3\n", "health.classes.a.nodes", "a string"),
        ("[ckpt]\nkey_file = 'etc/ckpt.key'\n", "ckpt.key_file", "absolute"),
        ("[ckpt]\njob_key_dir = ''\n", "ckpt.job_key_dir", "absolute"),
        ("[ckpt]\njob_key_dir = '/run/../etc'\n", "ckpt.job_key_dir", "absolute"),
        ("[ckpt]\ns3_bucket = 'b'\n", "ckpt.key_file", "s3_bucket without shared_root"),
    ],
)
def test_bad_values_name_the_file_the_key_and_what_is_expected(
    tmp_path: Path, text: str, key: str, expected: str
) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        config.load(p)
    assert err.value.key == key
    assert expected in err.value.expected
    assert str(p) in str(err.value)


@pytest.mark.parametrize("text", ["[ckpt]\ns3_bucket = 'b'\nkey_file = '/etc/gpuwarden/ckpt.key'\n",
                                  "[ckpt]\ns3_bucket = 'b'\nshared_root = '/fsx/ckpt'\n"])
def test_s3_without_a_shared_tier_loads_with_a_site_key_file(tmp_path: Path, text: str) -> None:
    cfg = config.load(write(tmp_path, text)).ckpt
    assert cfg.s3_bucket == "b" and cfg.job_key_dir == "/run/gpuwarden-ckpt"


def test_broken_toml_is_reported_with_its_position(tmp_path: Path) -> None:
    p = write(tmp_path, "[slurm\n")
    with pytest.raises(ConfigError, match=r"not valid TOML.*line 1"):
        config.load(p)


def test_float_fields_accept_integers(tmp_path: Path) -> None:
    assert config.load(write(tmp_path, "[slurm]\ncommand_timeout_s = 5\n")).slurm.command_timeout_s == 5.0


def test_shown_config_round_trips(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, "[cluster]\nnodes = 16\ngpu_type = 'a100'\n"))
    again = config.parse(config.dumps(cfg), "shown")
    assert again == cfg
    assert again.cluster.nodes == 16


def test_config_records_are_frozen() -> None:
    cfg = config.Config()
    with pytest.raises(AttributeError):
        cfg.slurm.retries = 9  # type: ignore[misc]


def test_node_classes_pick_expected_values_by_hostlist(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, "[health.classes.l40s]\nnodes = 'g[1-4]'\n"
                                      "expected = {gpu_count = 4}\n"))
    assert cfg.health.expected_for("g3").gpu_count == 4
    assert cfg.health.expected_for("c1").gpu_count == 8
