"""The weight-update group of issue 42 (``cbpause.client.weight_group``; ``check_manifest`` of
``cbpause.serve.distributed``): an update's manifest checked against the model before any collective, and tensors
broadcast from the trainer (rank 0) into a server's staging buffers over gloo, on a group of its own; a sender that
dies ends the receiver's broadcast with an error."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cbpause.client.weight_group import WeightGroup  # noqa: E402
from cbpause.integrations.manifest import check_manifest  # noqa: E402
from cbpause.serve.weights_io import weight_info  # noqa: E402
from cbpause.testing import HANG_S  # noqa: E402
from cbpause.testing.llama import tiny_llama  # noqa: E402
from cbpause.testing.servers import free_port  # noqa: E402

pytestmark = pytest.mark.layer("system")


def manifest_of(model) -> tuple[list, list, list]:
    info = weight_info(model)
    return list(info), [v["dtype"] for v in info.values()], [v["shape"] for v in info.values()]


def test_the_model_s_own_manifest_is_accepted_and_each_bad_entry_refused_by_name():
    model = tiny_llama("cpu")
    names, dtypes, shapes = manifest_of(model)
    manifest = check_manifest(model, names, dtypes, shapes)
    assert [m[0] for m in manifest] == names and manifest[0][2] == model.state_dict()[names[0]].dtype
    bad = {0: ("nope.weight", dtypes[0], shapes[0]), 1: (names[1], "float64", shapes[1]),
           2: (names[2], dtypes[2], [1, 2, 3]), 3: (names[3], "not_a_dtype", shapes[3]),
           4: (names[1], dtypes[1], shapes[1])}  # fmt: skip
    rows = [bad.get(i, (n, d, s)) for i, (n, d, s) in enumerate(zip(names, dtypes, shapes, strict=True))]
    with pytest.raises(ValueError) as refused:
        check_manifest(model, *[list(column) for column in zip(*rows, strict=True)])
    message = str(refused.value)
    for needle in ("nope.weight", "float64", "(1, 2, 3)", "not_a_dtype", "named twice"):
        assert needle in message, message
    for args in ((names, dtypes[:-1], shapes), ([], [], []), ("x", dtypes, shapes)):
        with pytest.raises(ValueError):
            check_manifest(model, *args)


def test_a_broadcast_update_arrives_whole_in_staging_buffers():
    sender, receiver = tiny_llama("cpu", seed=1), tiny_llama("cpu", seed=0)
    names, dtypes, shapes = manifest_of(receiver)
    manifest = check_manifest(receiver, names, dtypes, shapes)
    port, errors = free_port(), []

    def trainer() -> None:
        try:
            group = WeightGroup("127.0.0.1", port, 0, 2, timeout_s=HANG_S)
            state = sender.state_dict()
            group.send([state[name] for name in names])
            group.destroy()
        except BaseException as error:  # noqa: BLE001 -- reported below
            errors.append(error)

    thread = threading.Thread(target=trainer)
    thread.start()
    group = WeightGroup("127.0.0.1", port, 1, 2, timeout_s=HANG_S)
    received = group.receive(manifest)
    group.destroy()
    thread.join(HANG_S)
    assert not thread.is_alive() and errors == []
    state = sender.state_dict()
    assert list(received) == names and all(torch.equal(received[n], state[n]) for n in names)
    assert all(not torch.equal(received[n], receiver.state_dict()[n]) for n in names if "norm" not in n)


SENDER_DIES = """
import os, sys, torch
from cbpause.client.weight_group import WeightGroup  # noqa: E402
group = WeightGroup("127.0.0.1", int(sys.argv[1]), 0, 2, timeout_s=300)
group.send([torch.ones(4)])
os._exit(3)  # dies before the second tensor
"""


def test_a_sender_that_dies_mid_update_ends_the_receiver_s_broadcast_with_an_error():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", SENDER_DIES, str(port)])
    try:
        group = WeightGroup("127.0.0.1", port, 1, 2, timeout_s=HANG_S)
        with pytest.raises(RuntimeError):
            group.receive([("a", (4,), torch.float32), ("b", (4,), torch.float32)])
    finally:
        assert process.wait(HANG_S) == 3


def test_bad_group_arguments_are_refused_before_any_connection():
    for kwargs in ({"backend": "mpi"}, {"timeout_s": 0}, {"timeout_s": "5"}):
        with pytest.raises(ValueError):
            WeightGroup("127.0.0.1", free_port(), 1, 2, **kwargs)
    for rank, world in ((2, 2), (-1, 2), (0, 1)):
        with pytest.raises(ValueError):
            WeightGroup("127.0.0.1", free_port(), rank, world)
