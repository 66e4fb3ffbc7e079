"""tq.init(config): tqtx's own keys, and TransferQueue 0.1.11's config translated."""
from __future__ import annotations

import logging
from collections.abc import Mapping

import pytest

from tqtx.deploy.initconfig import resolve

# TransferQueue 0.1.11's default config (config.yaml), as a trainer passes it after merging
TQ_DEFAULT = {
    "metrics": {"enabled": False, "port": 0},
    "controller": {"sampler": "SequentialSampler", "polling_mode": False, "zmq_info": None},
    "backend": {
        "storage_backend": "SimpleStorage",
        "SimpleStorage": {"total_storage_size": None, "num_data_storage_units": 2,
                          "required_node_resource": None, "zmq_info": None,
                          "ssd_offload": {"enabled": False, "path": None,
                                          "threshold_bytes": 1048576}},
        "MooncakeStore": {"auto_init": True, "protocol": "tcp"},
    },
}


class FrozenMapping(Mapping):
    """A Mapping that is not a dict (as OmegaConf's DictConfig is not)."""

    def __init__(self, data):
        self._data = {k: FrozenMapping(v) if isinstance(v, dict) else v for k, v in data.items()}

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


def _records(caplog):
    return [r for r in caplog.records if r.name == "tqtx.init"]


def test_transferqueue_default_config_is_accepted_and_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="tqtx.init")
    cfg = resolve(TQ_DEFAULT)
    # controller.polling_mode is get_meta's (tqtx.compat.dataplane); the default sampler is tqtx's
    assert cfg == {"num_units": 2, "metrics": {"enabled": False, "port": 0},
                   "polling_mode": False}
    (rec,) = _records(caplog)
    assert rec.levelno == logging.INFO  # only known TransferQueue options were ignored
    for key in ("controller.zmq_info", "backend.SimpleStorage.total_storage_size",
                "backend.SimpleStorage.ssd_offload.threshold_bytes", "backend.MooncakeStore"):
        assert key in rec.getMessage()
    assert "sampler" not in rec.getMessage() and "polling_mode" not in rec.getMessage()
    assert resolve({"controller": {"sampler": "GRPOGroupNSampler"}}) == {}
    assert "controller.sampler='GRPOGroupNSampler'" in _records(caplog)[-1].getMessage()
    assert _records(caplog)[-1].levelno == logging.WARNING  # tqtx samples sequentially


def test_num_data_storage_units_is_num_units_and_mapping_configs_work(caplog):
    caplog.set_level(logging.INFO, logger="tqtx.init")
    conf = FrozenMapping({"backend": {"SimpleStorage": {"num_data_storage_units": 5}},
                          "state_dir": "/tmp/x"})
    assert resolve(conf) == {"num_units": 5, "state_dir": "/tmp/x"}
    assert _records(caplog) == []  # nothing was ignored: no log line


def test_tqtx_key_wins_over_transferqueue_key_and_says_so(caplog):
    caplog.set_level(logging.INFO, logger="tqtx.init")
    cfg = resolve({"num_units": 3, "backend": {"SimpleStorage": {"num_data_storage_units": 4}}})
    assert cfg["num_units"] == 3
    assert "num_data_storage_units=4 (num_units=3 wins)" in _records(caplog)[0].getMessage()


def test_unknown_keys_in_transferqueue_config_never_raise(caplog):
    caplog.set_level(logging.INFO, logger="tqtx.init")
    cfg = resolve({"controller": {"polling_mode": True}, "num_unit": 3, "enable": True,
                   "backend": {"storage_backend": "MooncakeStore", "MooncakeStore": {}},
                   "metrics": {"enabled": True, "port": 9100, "endpoint": "h:1"}})
    assert cfg == {"metrics": {"enabled": True, "port": 9100}, "polling_mode": True}
    (rec,) = _records(caplog)
    assert rec.levelno == logging.WARNING  # keys nobody knows, another backend
    msg = rec.getMessage()
    for key in ("num_unit", "enable", "backend.storage_backend='MooncakeStore'",
                "metrics.endpoint"):
        assert key in msg


def test_compat_transferqueue_marks_a_transferqueue_config():
    assert "num_unit" not in resolve({"compat": "transferqueue", "num_unit": 3})


def test_misspelt_tqtx_key_in_a_tqtx_config_raises():
    with pytest.raises(ValueError, match=r"unknown config keys: 'num_unit' \(did you mean "
                                         r"'num_units'\?\)"):
        resolve({"num_unit": 2, "state_dir": "/tmp/x"})
    with pytest.raises(ValueError, match="'state_dri'"):
        resolve({"state_dri": "/tmp/x"})


def test_unrelated_unknown_key_in_a_tqtx_config_is_ignored_with_a_warning(caplog):
    caplog.set_level(logging.INFO, logger="tqtx.init")
    assert resolve({"num_units": 1, "trainer_name": "ppo"}) == {"num_units": 1}
    (rec,) = _records(caplog)
    assert rec.levelno == logging.WARNING and "trainer_name" in rec.getMessage()


def test_config_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="dict or a DictConfig"):
        resolve(["num_units", 2])
