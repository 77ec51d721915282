"""ONNX Runtime's thread pools and KVFORGE_ORT_SPINNING (kvforge/ort_session.py): every session kvforge makes,
the runtime's, calibration's and the export's validation, blocks when idle instead of spinning where the variable
says 0; ORT's own default (spinning) otherwise; a value that is neither is refused by name. The oracle is ONNX
Runtime's own record of each session's options."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from kvforge.errors import KvforgeError
from kvforge.ort_session import SPINNING_ENV, make_session

KEYS = ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning")


def _relu() -> bytes:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def _entries(session) -> dict[str, str | None]:
    options = session.get_session_options()
    found = {}
    for key in KEYS:
        try:
            found[key] = options.get_session_config_entry(key)
        except Exception:  # noqa: BLE001 - ORT raises for an entry never set: its default (spinning) holds
            found[key] = None
    return found


def test_sessions_block_when_idle_where_the_environment_says_0(monkeypatch):
    monkeypatch.setenv(SPINNING_ENV, "0")
    session = make_session(_relu())
    assert _entries(session) == dict.fromkeys(KEYS, "0")
    assert session.run(None, {"x": np.array([-1.0, 2.0], np.float32)})[0].tolist() == [0.0, 2.0]
    monkeypatch.setenv(SPINNING_ENV, "1")
    assert _entries(make_session(_relu())) == dict.fromkeys(KEYS)  # ORT's default: spin


def test_a_value_that_is_not_0_or_1_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(SPINNING_ENV, "off")
    with pytest.raises(KvforgeError, match=f"{SPINNING_ENV} must be 0 .* or 1 .*got 'off'"):
        make_session(_relu())


def test_the_exports_validation_session_follows_it_too(monkeypatch, tmp_path):
    from kvforge.export.validate import OrtRunner

    path = tmp_path / "relu.onnx"
    path.write_bytes(_relu())
    monkeypatch.setenv(SPINNING_ENV, "0")
    assert _entries(OrtRunner(path, "float32").session) == dict.fromkeys(KEYS, "0")


def test_kvforge_ort_profile_writes_onnx_runtimes_profile_of_each_session(monkeypatch, tmp_path):
    import json

    from kvforge.ort_session import PROFILE_ENV

    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "relu"))
    session = make_session(_relu())
    assert session.get_session_options().enable_profiling  # ORT's own record of the option
    np.testing.assert_array_equal(session.run(None, {"x": np.array([-1.0, 2.0], np.float32)})[0], [0.0, 2.0])
    written = session.end_profiling()
    events = json.loads(open(written).read())
    assert written.startswith(str(tmp_path / "relu")) and any(
        e.get("cat") == "Node" and e.get("args", {}).get("op_name") == "Relu" for e in events)
    monkeypatch.delenv(PROFILE_ENV)
    assert not make_session(_relu()).get_session_options().enable_profiling
