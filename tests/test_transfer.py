"""The weight-transfer interface (issue 57): every transport checks what it will deliver before anything moves, then
delivers each tensor to the one sink; a server's one driver labels, tears and commits as FleetPause names it."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from cbpause.integrations.transfer import InProcess, ModelWriter, Transport  # noqa: E402
from cbpause.serve.leases import LeaseTable  # noqa: E402
from cbpause.serve.transfer import TransferFailed, WriteFailed, write  # noqa: E402
from cbpause.serve.transfer.broadcast import Broadcast  # noqa: E402
from cbpause.serve.transfer.cuda_ipc import CudaIpc  # noqa: E402
from cbpause.serve.transfer.disk import Disk  # noqa: E402
from cbpause.testing import HANG_S  # noqa: E402

from .test_serve import FakeManager  # noqa: E402

pytestmark = pytest.mark.layer("system")


class Manager(FakeManager):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 3))


def test_every_transport_has_the_interface_s_shape():
    for transport in (InProcess, Disk, Broadcast, CudaIpc):
        assert list(inspect.signature(transport.receive).parameters)[1:] == list(
            inspect.signature(Transport.receive).parameters)[1:], transport  # fmt: skip
    with pytest.raises(NotImplementedError, match="designed"):
        CudaIpc()


def test_a_disk_transport_checks_every_header_before_anything_is_read(tmp_path):
    from safetensors.torch import save_file

    manager = Manager()
    save_file({"0.weight": torch.ones(2, 2)}, str(tmp_path / "a.safetensors"))
    save_file({"1.weight": torch.ones(3, 2, dtype=torch.bfloat16)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match="bfloat16"):  # the second file's dtype, from its header
        Disk(manager.model, tmp_path, tmp_path)
    save_file({"1.weight": torch.full((3, 2), 2.0)}, str(tmp_path / "b.safetensors"))
    disk, delivered = Disk(manager.model, tmp_path, tmp_path), []
    disk.receive(lambda name, tensor: delivered.append((name, tensor.sum().item())))
    disk.close()
    assert disk.total == 2 and delivered == [("0.weight", 4.0), ("1.weight", 12.0)]


def test_in_process_tensors_are_checked_as_they_come_by_the_one_check():
    manager = Manager()
    writer = ModelWriter(manager.model)
    pairs = [("module.0.weight", torch.ones(2, 2)), ("2.weight", torch.ones(2, 2))]  # a wrapper's prefix, then none
    with pytest.raises(KeyError, match="no tensor '2.weight'"):
        InProcess(manager.model, pairs).receive(writer.load)
    assert writer.copied == 1 and torch.equal(manager.model[0].weight, torch.ones(2, 2))


class Failing:
    """A transport that delivers ``good`` tensors, then fails (as a lost peer does)."""

    def __init__(self, good: int, staged: bool) -> None:
        self.good, self.staged = good, staged

    def receive(self, load, progress=None) -> None:
        for name, tensor in [("0.weight", torch.ones(2, 2)), ("1.weight", torch.ones(3, 2))][: self.good]:
            load(name, tensor)
        raise TransferFailed("the peer is gone")


@pytest.mark.parametrize(("good", "staged"), [(0, True), (1, True), (1, False), (0, False)])
def test_the_driver_tears_the_weights_only_once_a_tensor_was_copied(good, staged):
    from cbpause.integrations.weights import PartialSync

    manager, records = Manager(), []
    table = LeaseTable(manager, default_ttl=HANG_S, log=records.append)
    lease = table.pause_lease(holder="t")
    with table.write_weights(lease.id, version=5, staged=staged) as writing, pytest.raises(WriteFailed) as failed:
        write(table, writing, manager, Failing(good, staged), 5, seconds=HANG_S)
    assert failed.value.torn == bool(good) and (table.torn is not None) == bool(good)
    assert manager.versions == ([PartialSync(5)] if good else [])
    actions = [r["a"] for r in records]
    assert ("Received" in actions) == (staged and bool(good)) and actions[-1] == "WriteFail", actions
    assert table.resume_lease(lease.id) is True
    table.close()


def test_a_disk_file_written_again_in_place_after_its_check_is_never_delivered_as_the_checked_one(tmp_path):
    """Found by a hostile review: the files were mapped at the check, and a file truncated under the mapping ended the
    server (SIGBUS), one rewritten in place was delivered as the checked one.  Read with pread, a changed file fails
    the transfer; one replaced by a rename is read as it was checked."""
    import os

    from safetensors.torch import save_file

    manager = Manager()
    path = tmp_path / "a.safetensors"
    for change in ("truncate", "rewrite", "replace"):
        save_file({"0.weight": torch.ones(2, 2), "1.weight": torch.ones(3, 2)}, str(path))
        disk, delivered = Disk(manager.model, path, tmp_path), []
        if change == "truncate":
            os.truncate(path, 40)
        elif change == "rewrite":
            data = path.read_bytes()
            path.write_bytes(data[:-4] + b"AAAA")
        else:
            save_file({"0.weight": torch.zeros(2, 2), "1.weight": torch.zeros(3, 2)}, str(tmp_path / "b.tmp"))
            os.replace(tmp_path / "b.tmp", path)
        try:
            if change == "replace":
                disk.receive(lambda name, tensor, out=delivered: out.append(tensor.sum().item()))
                assert delivered == [4.0, 6.0]  # the checked file's bytes
            else:
                with pytest.raises(TransferFailed, match="changed"):
                    disk.receive(lambda name, tensor, out=delivered: out.append(tensor.sum().item()))
        finally:
            disk.close()


def test_in_process_tensors_named_twice_or_not_tensors_are_refused():
    manager = Manager()
    writer = ModelWriter(manager.model)
    with pytest.raises(ValueError, match="named twice"):
        InProcess(manager.model, [("0.weight", torch.ones(2, 2)), ("module.0.weight", torch.ones(2, 2))]).receive(
            writer.load)  # fmt: skip
    with pytest.raises(ValueError, match="not a tensor"):
        InProcess(manager.model, [("0.weight", [[1.0, 1.0], [1.0, 1.0]])]).receive(writer.load)
