"""The built-in server's checked unpickler for /update_weights_from_tensor
(rlctl/engines/weightsync/ipc_open.py), on payloads made by hand: each refusal happens before
anything is mapped, grown, written, unlinked or connected, and the shared-memory file a payload
names is left exactly as it was. The files here are made as torch makes them (a 64-byte header,
then the data) but written directly, so no torch_shm_manager process starts."""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
import secrets

import pytest
import torch
from torch.multiprocessing import reductions

from rlctl.engines.weightsync import ipc
from rlctl.engines.weightsync.ipc_handles import SHM_DIR, SHM_HEADER, Refused
from rlctl.engines.weightsync.ipc_open import loads

KEY = ipc.ipc_key("the run's token")


class Segment:
    """A torch-named shared-memory file of `nbytes` data bytes, tagged for KEY unless told not."""

    def __init__(self, data: bytes, tag: bytes | None = KEY) -> None:
        self.name = f"/torch_{os.getpid()}_{secrets.randbelow(2**32)}_{secrets.randbelow(1000)}"
        nbytes = len(data) + ipc.TAG_BYTES
        trailer = ipc.tag_for(tag, nbytes) if tag is not None else secrets.token_bytes(ipc.TAG_BYTES)
        self.path = SHM_DIR + self.name
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, bytes(SHM_HEADER) + data + trailer)
        os.close(fd)
        self.nbytes = nbytes

    def state(self) -> tuple:
        st = os.stat(self.path)
        with open(self.path, "rb") as f:
            return st.st_size, st.st_mtime_ns, hashlib.sha256(f.read()).hexdigest()

    def remove(self) -> None:
        os.unlink(self.path)


@pytest.fixture
def segments():
    made: list[Segment] = []

    def make(data: bytes, tag: bytes | None = KEY) -> Segment:
        made.append(Segment(data, tag))
        return made[-1]

    yield make
    for s in made:
        s.remove()


class Call:
    """Pickles as fn(*args): a payload's nested reductions, made by hand."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def over(seg: Segment, dtype=torch.float32, offset=0, size=(4,), stride=(1,), manager=b"", nbytes=None):
    storage = Call(
        reductions.rebuild_storage_filename,
        torch.UntypedStorage,
        manager,
        seg.name.encode(),
        seg.nbytes if nbytes is None else nbytes,
    )
    typed = Call(reductions.rebuild_typed_storage, storage, dtype)
    return Call(reductions.rebuild_tensor, torch.Tensor, typed, (offset, torch.Size(size), stride, False))


def payload(*pairs) -> str:
    return base64.b64encode(pickle.dumps(list(pairs), protocol=pickle.HIGHEST_PROTOCOL)).decode()


FLOATS = torch.arange(8, dtype=torch.float32).numpy().tobytes()
MODEL = {"w": torch.zeros(4), "m": torch.zeros(2, 2)}


def test_a_tagged_buffer_of_the_trainer_is_read_as_it_lies(segments):
    seg = segments(FLOATS)
    got = loads(
        payload(("w", over(seg, offset=4)), ("m", over(seg, size=(2, 2), stride=(2, 1)))), key=KEY, params=MODEL
    )
    assert [n for n, _ in got] == ["w", "m"]
    assert got[0][1].tolist() == [4.0, 5.0, 6.0, 7.0] and got[1][1].tolist() == [[0.0, 1.0], [2.0, 3.0]]


def test_shared_memory_the_trainer_did_not_tag_is_refused_and_left_as_it_was(segments):
    for seg in (segments(FLOATS, tag=None), segments(FLOATS, tag=ipc.ipc_key("another run's token"))):
        before = seg.state()
        with pytest.raises(Refused, match="not a buffer of this run's trainer"):
            loads(payload(("w", over(seg))), key=KEY, params=MODEL)
        assert os.path.exists(seg.path) and seg.state() == before


def test_a_size_other_than_the_files_is_refused_and_the_file_is_not_grown(segments):
    seg = segments(FLOATS)
    before = seg.state()
    for nbytes in (seg.nbytes + 4096, seg.nbytes - 4):
        with pytest.raises(Refused, match=f"holds {seg.nbytes} bytes"):
            loads(payload(("w", over(seg, nbytes=nbytes))), key=KEY)
    assert seg.state() == before


def test_a_manager_socket_named_in_the_payload_is_refused_before_anything_opens(segments, tmp_path):
    seg = segments(FLOATS)
    before = seg.state()
    for manager in (str(tmp_path / "manager.sock").encode(), b"/tmp/torch-shm-dir-x/manager.sock"):
        with pytest.raises(Refused, match="connects to none"):
            loads(payload(("w", over(seg, manager=manager))), key=KEY)
    assert seg.state() == before and not (tmp_path / "manager.sock").exists()


def test_a_tensor_reaching_past_its_storage_is_refused(segments):
    seg = segments(FLOATS)  # 8 floats of data, then the 32-byte tag: a storage of 64 bytes, 16 floats
    before = seg.state()
    for offset, size, stride in ((14, (4,), (1,)), (0, (2, 2), (15, 1)), (0, (17,), (1,))):
        with pytest.raises(Refused, match="reaches .* into a storage of 64"):
            loads(payload(("w", over(seg, offset=offset, size=size, stride=stride))), key=KEY)
    assert seg.state() == before


def test_a_fresh_storage_or_tensor_is_refused_never_read():
    fresh = Call(torch.UntypedStorage, 4096)  # what the allocator last held there
    for tensor in (
        Call(
            reductions.rebuild_tensor,
            torch.Tensor,
            Call(reductions.rebuild_typed_storage, fresh, torch.float32),
            (0, torch.Size((16,)), (1,), False),
        ),
        Call(torch.Tensor, 16),
    ):
        with pytest.raises(Refused, match="may be named in a weight pickle, not called"):
            loads(payload(("w", tensor)), key=KEY)


def test_a_name_outside_torchs_shared_memory_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 100)
    for name in (b"/../" + str(victim).encode(), b"/some-other-program", b"torch_1_2_3"):
        fake = Call(reductions.rebuild_storage_filename, torch.UntypedStorage, b"", name, 36)
        tensor = Call(
            reductions.rebuild_tensor,
            torch.Tensor,
            Call(reductions.rebuild_typed_storage, fake, torch.uint8),
            (0, torch.Size((4,)), (1,), False),
        )
        with pytest.raises(Refused, match="not the name of one of torch's shared-memory files"):
            loads(payload(("w", tensor)), key=KEY)
    assert victim.read_bytes() == b"x" * 100


def test_a_tensor_must_fit_the_models_parameter_of_its_name(segments):
    seg = segments(FLOATS)
    with pytest.raises(Refused, match="unknown parameter name 'lm_head.bias'"):
        loads(payload(("lm_head.bias", over(seg))), key=KEY, params=MODEL)
    with pytest.raises(Refused, match=r"m: a tensor of shape \[4\] for the model's \[2, 2\]"):
        loads(payload(("m", over(seg))), key=KEY, params=MODEL)
    with pytest.raises(Refused, match="w: a torch.int32 tensor for the model's torch.float32"):
        loads(payload(("w", over(seg, dtype=torch.int32))), key=KEY, params=MODEL)
    assert loads(payload(("w", over(seg, dtype=torch.bfloat16))), key=KEY, params=MODEL)  # cast on load, as SGLang


def test_a_pickle_that_is_not_a_list_of_named_tensors_is_refused(segments):
    seg = segments(FLOATS)
    for body in ([("w", over(seg), "extra")], [(b"w", over(seg))], [("w", "not a tensor")]):
        with pytest.raises(Refused):
            loads(base64.b64encode(pickle.dumps(body)).decode(), key=KEY)
