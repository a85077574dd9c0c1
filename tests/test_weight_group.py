"""The weight-update group (``cbpause.client.weight_group``, its packed buckets ``cbpause.client.buckets``, and
``check_manifest`` of ``cbpause.integrations.manifest``): an update's manifest checked against the model before any
collective, tensors packed into checked buckets and broadcast from the trainer (rank 0) into a server's staging buffers
over gloo, on a group of its own; a sender that dies ends the receiver's broadcast with an error; the staging slots'
file reserved where there is room."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cbpause.client import buckets  # noqa: E402
from cbpause.client.weight_group import WeightGroup  # noqa: E402
from cbpause.integrations.manifest import check_manifest  # noqa: E402
from cbpause.serve.transfer.disk import weight_info  # noqa: E402
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
from cbpause.client import buckets  # noqa: E402
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


ODD = [("a", (3, 5), torch.float32), ("b", (7,), torch.bfloat16), ("c", (100,), torch.float64), ("d", (), torch.int64),
       ("e", (4,), torch.bool), ("f", (0, 3), torch.float16), ("g", (2, 2), torch.complex128), ("h", (5,), torch.int8)]


def test_buckets_round_trip_every_dtype_and_a_tensor_past_the_size_has_a_bucket_of_its_own():
    tensors = [torch.randn(shape).to(dtype) if dtype.is_floating_point or dtype.is_complex else
               torch.randint(0, 2, shape).to(dtype) for _, shape, dtype in ODD]  # fmt: skip
    for size in (1024, 4096, 1 << 20):
        layout = buckets.layout(ODD, size)
        assert [s.name for b in layout for s in b.slots] == [n for n, _, _ in ODD]
        assert all(b.nbytes <= size or len(b.slots) == 1 for b in layout)
        assert all(s.offset % buckets.ALIGN == 0 for b in layout for s in b.slots)
        start = 0
        for bucket in layout:
            part = tensors[start : start + len(bucket.slots)]
            start += len(bucket.slots)
            packed = buckets.pack(bucket, part)
            head = buckets.header(bucket, packed)
            arrived = torch.full((bucket.nbytes,), 255, dtype=torch.uint8)
            arrived.copy_(packed)
            assert buckets.refusal(bucket, head, buckets.checksum(arrived)) is None
            assert all(torch.equal(got, want) for (_, got), want in zip(buckets.unpack(bucket, arrived), part,
                                                                      strict=True))  # fmt: skip
    big = buckets.layout([("x", (600,), torch.float32), ("y", (2,), torch.float32)], 1024)
    assert [len(b.slots) for b in big] == [1, 1] and big[0].nbytes > 1024
    for bad in (1023, 2**33, True, 1.5, "64"):
        with pytest.raises(ValueError, match="bucket_bytes"):
            buckets.layout(ODD, bad)


def test_a_bucket_whose_bytes_or_header_are_not_the_layout_s_is_refused_by_name():
    bucket = buckets.layout([("w", (64,), torch.float32)], 1024)[0]
    packed = buckets.pack(bucket, [torch.randn(64)])
    head = buckets.header(bucket, packed)
    short = torch.full((bucket.nbytes,), 255, dtype=torch.uint8)
    short[: bucket.nbytes // 2].copy_(packed[: bucket.nbytes // 2])
    assert "checksum" in buckets.refusal(bucket, head, buckets.checksum(short))
    other = torch.full((bucket.nbytes,), 255, dtype=torch.uint8)  # bfloat16 for float32: half the bytes
    other[: bucket.nbytes // 2].copy_(torch.randn(64).bfloat16().view(torch.uint8))
    assert "checksum" in buckets.refusal(bucket, head, buckets.checksum(other))
    assert "bucket 3" in buckets.refusal(bucket, [buckets.MAGIC, 3, bucket.nbytes, head[3]], head[3])
    assert "not a cbpause bucket" in buckets.refusal(bucket, [0, 0, bucket.nbytes, head[3]], head[3])
    with pytest.raises(ValueError, match="manifest says"):
        buckets.pack(bucket, [torch.randn(32)])


def test_the_staging_slots_go_where_there_is_room_and_a_full_place_is_named(monkeypatch, tmp_path):
    """A review found a child that wrote into a full /dev/shm (a container's is 64 MiB) die of SIGBUS, blamed on the
    sender: the slots' space is reserved first, in /dev/shm or else the temporary directory."""
    import errno
    import os

    from cbpause.serve.receiver import slot_file

    full, roomy = tmp_path / "full", tmp_path / "roomy"
    full.mkdir()
    roomy.mkdir()
    reserve = os.posix_fallocate

    def fallocate(fd, offset, length):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(full)):
            raise OSError(errno.ENOSPC, "No space left on device")
        reserve(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    path = slot_file(4096, places=(str(full), str(roomy)))
    assert path.startswith(str(roomy)) and os.path.getsize(path) == 4096 and not os.listdir(full)
    with pytest.raises(OSError, match="No space left") as none:
        slot_file(4096, places=(str(full),))
    assert str(full) in str(none.value) and not os.listdir(full)
