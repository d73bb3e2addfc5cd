"""Streaming weights from a safetensors checkpoint into a model built on the meta device: the
values go from the file straight into the pinned host store, outputs are bitwise the
materialized model's, and a checkpoint that does not match fails before anything changes."""

from __future__ import annotations

import ctypes
import json
import struct

import pytest
import torch

from torchoffload import stream_weights
from torchoffload.models import GPT, GPTConfig
from torchoffload.weights._checkpoint import Checkpoint, CheckpointError

CFG = GPTConfig(hidden=64, layers=4, heads=4, vocab=128, max_seq=64)
_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
}


def save(tensors: dict[str, torch.Tensor], path, *, truncate=0, dtype_names=None):
    """A minimal safetensors writer (the format: 8-byte header length, JSON header, bytes)."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        flat = t.detach().contiguous().cpu().view(torch.uint8).flatten()
        data = ctypes.string_at(flat.data_ptr(), flat.numel())
        dtype = (dtype_names or {}).get(name, _NAMES[t.dtype])
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}  # fmt: skip
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    body = b"".join(blobs)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + body[: len(body) - truncate])
    return path


def reference():
    torch.manual_seed(0)
    return GPT(CFG).eval()


def on_meta():
    with torch.device("meta"):
        return GPT(CFG).eval()


def unique_state(model):
    """state_dict without the second name of tied weights (as Hugging Face saves them)."""
    seen, out = set(), {}
    for name, t in model.state_dict().items():
        if t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def tokens():
    return torch.randint(0, CFG.vocab, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("unit", ["blocks", "leaves"])
def test_meta_model_streams_from_a_checkpoint_bitwise(tmp_path, unit):
    ref = reference()
    path = save(unique_state(ref), tmp_path / "model.safetensors")
    model = on_meta()
    assert model.head.weight is model.tok.weight
    handle = stream_weights(
        model, "cpu", budget_bytes=1 << 20, unit=unit, pin_memory=False, checkpoint=path
    )
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(tokens()), ref(tokens()))
    sd = model.state_dict()  # real values, from the host store
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    handle.remove()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.device.type == "cpu" and torch.equal(p, q), name
    assert model.head.weight is model.tok.weight
    with torch.no_grad():
        assert torch.equal(model(tokens()), ref(tokens()))


def test_resident_tensors_come_from_the_checkpoint_too(tmp_path):
    ref = reference()
    save(unique_state(ref), tmp_path / "model.safetensors")
    model = on_meta()
    handle = stream_weights(
        model, "cpu", budget_bytes=1 << 20, resident=("tok", "pos"), pin_memory=False,
        checkpoint=tmp_path,  # a directory holding model.safetensors
    )  # fmt: skip
    assert handle.stats().resident_bytes > 0
    with torch.no_grad():
        assert torch.equal(model(tokens()), ref(tokens()))
    handle.remove()
    assert torch.equal(model.pos.weight, ref.pos.weight)


def test_a_real_model_takes_the_checkpoints_values(tmp_path):
    """A materialized model with a checkpoint: the checkpoint's values are streamed (like
    load_state_dict), its own are not used."""
    ref = reference()
    path = save(unique_state(ref), tmp_path / "model.safetensors")
    torch.manual_seed(123)
    model = GPT(CFG).eval()
    handle = stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=path)
    with torch.no_grad():
        assert torch.equal(model(tokens()), ref(tokens()))
    handle.remove()


def test_safetensors_package_files_and_sharded_index(tmp_path):
    """Files written by the safetensors package, split into shards with an index."""
    st = pytest.importorskip("safetensors.torch")
    ref = reference()
    state = unique_state(ref)
    names = list(state)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for file, part in shards.items():
        st.save_file({n: state[n].contiguous() for n in part}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = on_meta()
    handle = stream_weights(
        model, "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=tmp_path
    )
    with torch.no_grad():
        assert torch.equal(model(tokens()), ref(tokens()))
    handle.remove()


def bad_checkpoints(tmp_path):
    ref = reference()
    state = unique_state(ref)
    missing = dict(state)
    missing.pop("layers.1.fc1.weight")
    shape = dict(state)
    shape["layers.0.qkv.weight"] = state["layers.0.qkv.weight"][:-1]
    dtype = {k: v.to(torch.bfloat16) if k == "ln_f.weight" else v for k, v in state.items()}
    return {
        "missing": (save(missing, tmp_path / "m.safetensors"), "not in the checkpoint"),
        "shape": (save(shape, tmp_path / "s.safetensors"), r"\[192, 64\] torch.float32 in the"),
        "dtype": (save(dtype, tmp_path / "d.safetensors"), "torch.bfloat16 in"),
        "truncated": (save(state, tmp_path / "t.safetensors", truncate=10), "truncated"),
        "offsets": (
            save(state, tmp_path / "o.safetensors", dtype_names={"pos.weight": "F16"}),
            "data_offsets span",
        ),
        "not_safetensors": (tmp_path / "x.safetensors", "not a safetensors file"),
        "nothing_there": (tmp_path / "absent", "does not exist"),
        "empty_dir": (tmp_path, "neither"),
    }


@pytest.mark.parametrize(
    "case",
    ["missing", "shape", "dtype", "truncated", "offsets", "not_safetensors", "nothing_there",
     "empty_dir"],
)  # fmt: skip
def test_a_bad_checkpoint_fails_before_anything_changes(tmp_path, case):
    files = tmp_path / "files"
    files.mkdir()
    (files / "x.safetensors").write_bytes(b"\xff" * 16)
    path, message = bad_checkpoints(files)[case]
    if case == "empty_dir":
        path = tmp_path / "empty"
        path.mkdir()
    model = on_meta()
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    with pytest.raises(CheckpointError, match=message):
        stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=path)
    assert all(p.is_meta for p in model.parameters())
    assert hooks == [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def test_a_meta_model_without_a_checkpoint_is_refused():
    with pytest.raises(ValueError, match="pass checkpoint="):
        stream_weights(on_meta(), "cpu", budget_bytes=1 << 20, pin_memory=False)
    with pytest.raises(TypeError, match="checkpoint must be a path"):
        stream_weights(on_meta(), "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=3)


def test_catalog_lists_every_tensor(tmp_path):
    ref = reference()
    state = unique_state(ref)
    cp = Checkpoint.open(save(state, tmp_path / "model.safetensors"))
    assert set(cp.entries) == set(state)
    assert cp.nbytes == sum(t.numel() * t.element_size() for t in state.values())
    e = cp.entries["layers.0.qkv.weight"]
    assert e.dtype == torch.float32 and e.shape == (192, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_meta_model_streams_from_a_checkpoint_on_cuda(tmp_path, gpu_deterministic):
    ref = reference().cuda()
    path = save(unique_state(ref), tmp_path / "model.safetensors")
    model = on_meta()
    handle = stream_weights(model, "cuda", budget_bytes=1 << 20, checkpoint=path)
    x = tokens().cuda()
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), ref(x))
    assert handle._runtime.host.is_pinned()
    handle.remove()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.device.type == "cpu" and torch.equal(p, q.cpu())


def test_checkpoint_of_another_model_is_refused(tmp_path):
    """A real model and a checkpoint none of whose names match (a prefix differs): an error,
    not the model's own values served silently."""
    state = {f"model.{k}": v for k, v in unique_state(reference()).items()}
    path = save(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no tensor of the model is in the checkpoint"):
        stream_weights(reference(), "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=path)


def test_malformed_headers_and_indexes_are_refused(tmp_path):
    state = unique_state(reference())
    path = save(state, tmp_path / "model.safetensors")
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    first, second = list(header)[:2]
    header[second]["data_offsets"] = [
        0,
        header[second]["data_offsets"][1] - header[second]["data_offsets"][0],
    ]  # overlaps the first tensor's bytes
    head = json.dumps(header).encode()
    bad = tmp_path / "overlap.safetensors"
    bad.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n :])
    with pytest.raises(CheckpointError, match="overlap"):
        Checkpoint.open(bad)
    outside = tmp_path / "sub"
    outside.mkdir()
    (outside / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {first: "../model.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="outside its directory"):
        Checkpoint.open(outside)
    (outside / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1]}))
    with pytest.raises(CheckpointError, match="weight_map"):
        Checkpoint.open(outside)


def test_parameter_class_and_attributes_survive_loading(tmp_path):
    class Tagged(torch.nn.Parameter):
        pass

    ref = reference()
    path = save(unique_state(ref), tmp_path / "model.safetensors")
    model = on_meta()
    w = model.layers[0].fc1.weight
    model.layers[0].fc1.weight = Tagged(w)
    model.layers[0].fc1.weight.note = "keep me"
    handle = stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=path)
    p = model.layers[0].fc1.weight
    assert type(p) is Tagged and p.note == "keep me"
    with torch.no_grad():
        assert torch.equal(model(tokens()), ref(tokens()))
    handle.remove()
    assert type(model.layers[0].fc1.weight) is Tagged


def test_a_tied_tensor_saved_twice_must_hold_one_value(tmp_path):
    ref = reference()
    both = {k: v.clone() for k, v in ref.state_dict().items()}  # tok.weight and head.weight
    path = save(both, tmp_path / "equal.safetensors")
    model = on_meta()
    handle = stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=path)
    with torch.no_grad():
        assert torch.equal(model(tokens()), ref(tokens()))
    handle.remove()
    both["head.weight"] = both["head.weight"].clone()
    both["head.weight"][3, 5] += 1.0
    path = save(both, tmp_path / "differ.safetensors")
    model = on_meta()
    with pytest.raises(CheckpointError, match="tied tensor .* different values"):
        stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=path)
    assert model.tok.weight.is_meta  # nothing changed
    both["head.weight"] = both["head.weight"][:, :-1].contiguous()
    path = save(both, tmp_path / "shape.safetensors")
    with pytest.raises(CheckpointError, match="one tied tensor"):
        stream_weights(on_meta(), "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=path)


class WithBuffers(torch.nn.Module):
    """A persistent buffer and a non-persistent one (a table computed at construction)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))
        self.register_buffer("table", torch.arange(8.0), persistent=False)

    def forward(self, x):
        return self.b(self.a(x) * self.scale + self.table)


@pytest.mark.parametrize("resident", [(), ("table",)])
def test_a_non_persistent_buffer_is_not_taken_from_the_checkpoint(tmp_path, resident):
    """A checkpoint that holds a tensor under a non-persistent buffer's name (older Hugging
    Face checkpoints hold ``rotary_emb.inv_freq``): not a ``state_dict()`` name, so torch's
    ``load_state_dict(strict=False)`` ignores it and the buffer keeps its own values; so does
    the stream. It was read into the buffer (every output off by up to 78 here)."""
    torch.manual_seed(0)
    ref = WithBuffers().eval()
    state = {**ref.state_dict(), "table": torch.full((8,), 100.0)}
    path = save(state, tmp_path / "model.safetensors")
    want = WithBuffers().eval()
    result = want.load_state_dict(state, strict=False)
    assert result.unexpected_keys == ["table"]
    model = WithBuffers().eval()
    handle = stream_weights(
        model, "cpu", budget_bytes=1 << 20, unit="leaves", resident=resident,
        pin_memory=False, checkpoint=path,
    )  # fmt: skip
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(x), want(x))
    handle.remove()
    assert torch.equal(model.table, torch.arange(8.0))
    with torch.device("meta"):
        model = WithBuffers().eval()
    with pytest.raises(CheckpointError, match="'table'.*no values"):
        stream_weights(model, "cpu", budget_bytes=1 << 20, unit="leaves", resident=resident,
                       pin_memory=False, checkpoint=path)  # fmt: skip


def test_entries_of_every_safetensors_dtype_torch_has_are_read(tmp_path):
    """A checkpoint holding a tensor of a dtype such as U32 (which the safetensors package
    reads) that the model does not use: the model's tensors load; it was refused whole as a
    "bad header entry"."""
    st = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    ref = WithBuffers().eval()
    extra = {
        "u16": torch.tensor([1, 2], dtype=torch.uint16),
        "u32": torch.tensor([1, 2], dtype=torch.uint32),
        "u64": torch.tensor([1, 2], dtype=torch.uint64),
        "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
    }
    path = tmp_path / "model.safetensors"
    st.save_file({**ref.state_dict(), **extra}, str(path))
    cp = Checkpoint.open(path)
    assert {n: cp.entries[n].dtype for n in extra} == {n: t.dtype for n, t in extra.items()}
    with torch.device("meta"):
        model = WithBuffers().eval()
    model.table = torch.arange(8.0)
    handle = stream_weights(
        model, "cpu", budget_bytes=1 << 20, unit="leaves", pin_memory=False, checkpoint=path
    )
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    handle.remove()


class WithEmpty(torch.nn.Module):
    """A parameter and a buffer with no elements (the buffer not contiguous: strides kept)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.e = torch.nn.Parameter(torch.empty(0, 8))
        self.register_buffer("z", torch.empty(8, 0).t())

    def forward(self, x):
        return self.a(x) + self.e.sum(0) + self.z.sum(0)


@pytest.mark.parametrize("in_checkpoint", [True, False])
def test_an_empty_tensor_on_meta_comes_to_the_host(tmp_path, in_checkpoint):
    """A parameter or buffer with no elements on a meta model has no bytes to read: it is
    made on the compute device, the same object with its shape, dtype and strides (as torch's
    ``load_state_dict(assign=True)`` gives it), and is on the host after ``remove()``, as
    every tensor that was on meta. It stayed on meta (the forward raised "Tensor on device
    meta is not on the expected device cpu!", and so did the model after ``remove()``)."""
    torch.manual_seed(0)
    ref = WithEmpty().eval()
    state = ref.state_dict() if in_checkpoint else {"a.weight": ref.a.weight, "a.bias": ref.a.bias}
    path = save(state, tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = WithEmpty().eval()
    e, z = model.e, model.z
    geometry = [(t.shape, t.stride(), t.dtype) for t in (e, z)]
    handle = stream_weights(
        model, "cpu", budget_bytes=1 << 20, unit="leaves", pin_memory=False, checkpoint=path
    )
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    for removed in (False, True):
        if removed:
            handle.remove()
        assert model.e is e and model.z is z and type(e) is torch.nn.Parameter and e.requires_grad
        assert [t.device.type for t in (e, z)] == ["cpu", "cpu"]
        assert [(t.shape, t.stride(), t.dtype) for t in (e, z)] == geometry
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))


def test_an_empty_tensor_of_a_real_model_is_left_alone(tmp_path):
    """The same model, materialized: its empty tensors stay the objects and storages they
    were, through streaming and ``remove()``."""
    torch.manual_seed(0)
    ref = WithEmpty().eval()
    path = save(ref.state_dict(), tmp_path / "model.safetensors")
    model = WithEmpty().eval()
    datas = [(t, t.data, t.untyped_storage()._cdata) for t in (model.e, model.z)]
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    for checkpoint in (path, None):
        handle = stream_weights(
            model, "cpu", budget_bytes=1 << 20, unit="leaves", pin_memory=False,
            checkpoint=checkpoint,
        )  # fmt: skip
        for t, _, storage in datas:
            assert t.untyped_storage()._cdata == storage
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
        handle.remove()
        assert [model.e, model.z] == [t for t, _, _ in datas]
        for t, _, storage in datas:
            assert t.untyped_storage()._cdata == storage


def test_an_empty_tensor_of_another_shape_in_the_checkpoint_is_refused(tmp_path):
    torch.manual_seed(0)
    state = {**WithEmpty().state_dict(), "e": torch.empty(0, 4)}
    path = save(state, tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = WithEmpty().eval()
    with pytest.raises(CheckpointError, match=r"'e' is \[0, 8\]"):
        stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=path)
    assert model.e.is_meta and model.a.weight.is_meta


def test_an_empty_tensor_needs_no_checkpoint_and_may_be_named_resident():
    """A real model whose only meta tensor has no elements streams without a checkpoint (the
    tensor is made on the device), and ``resident=`` may name it (that raised StopIteration):
    it is on the device anyway, in no unit and not listed as resident."""
    torch.manual_seed(0)
    ref = WithEmpty().eval()
    model = WithEmpty().eval()
    model.load_state_dict(ref.state_dict())
    model.e = torch.nn.Parameter(torch.empty(0, 8, device="meta"))
    e = model.e
    handle = stream_weights(model, "cpu", budget_bytes=1 << 20, resident=("e",), pin_memory=False)
    assert model.e is e and e.device.type == "cpu" and handle.resident == []
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    handle.remove()
    assert model.e is e and e.device.type == "cpu" and e.shape == (0, 8)


class Transposed(torch.nn.Module):
    """A parameter stored transposed (not contiguous, but no view into a larger storage)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.randn(8, 8).t())
        self.v = torch.nn.Parameter(torch.randn(4, 8, 2).permute(2, 0, 1))

    def forward(self, x):
        return torch.nn.functional.linear(self.a(x), self.w) + self.v.sum((0, 1))


@pytest.mark.parametrize("resident", [(), ("w", "v")])
@pytest.mark.parametrize("on", ["meta", "cpu"])
def test_a_transposed_parameter_loads_with_its_strides(tmp_path, on, resident):
    """A parameter that is not contiguous but dense (a transposed weight) is loaded from the
    checkpoint, keeping its strides as torch's ``load_state_dict`` does; outputs are bitwise
    the loaded model's. It was refused as "a view into a larger storage"."""
    torch.manual_seed(0)
    ref = Transposed().eval()
    path = save(ref.state_dict(), tmp_path / "model.safetensors")
    want = Transposed().eval()
    want.load_state_dict(ref.state_dict())
    strides = [(8, 1), (1, 8), (1, 16, 2)]
    assert [t.stride() for t in (want.a.weight, want.w, want.v)] == strides
    torch.manual_seed(1)
    with torch.device(on):
        model = Transposed().eval()
    w, v = model.w, model.v
    handle = stream_weights(
        model, "cpu", budget_bytes=1 << 20, unit="leaves", resident=resident,
        pin_memory=False, checkpoint=path,
    )  # fmt: skip
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    for removed in (False, True):
        if removed:
            handle.remove()
        assert model.w is w and model.v is v
        assert [t.stride() for t in (model.a.weight, w, v)] == strides
        with torch.no_grad():
            assert torch.equal(model(x), want(x))
        state = model.state_dict()
        assert all(torch.equal(state[k], t) for k, t in want.state_dict().items())
    assert [t.device.type for t in model.parameters()] == ["cpu"] * 4


def test_parameters_a_checkpoint_cannot_fill_are_refused_by_what_they_are(tmp_path):
    """A view into a larger storage, or a tensor whose elements share memory (expanded), is
    refused naming what it is and what to do."""
    torch.manual_seed(0)
    ref = Transposed().eval()
    path = save(ref.state_dict(), tmp_path / "model.safetensors")
    cases = {
        "a view into a larger storage": torch.randn(8, 16)[:, :8],
        "share memory": torch.randn(8, 1).expand(8, 8),
    }
    for message, value in cases.items():
        model = Transposed().eval()
        model.w = torch.nn.Parameter(value)
        with pytest.raises(CheckpointError, match=f"'w' .*{message}.*contiguous"):
            stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=path)


def snapshot(model):
    """What a refused call must leave as it was: every tensor's object, values and device, the
    hooks, and no engine attached."""
    tensors = [
        (n, t, t.detach().clone(), t.device) for n, t in model.state_dict(keep_vars=True).items()
    ]
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    return tensors, hooks


def assert_unchanged(model, before):
    tensors, hooks = before
    now = model.state_dict(keep_vars=True)
    for name, t, value, device in tensors:
        assert now[name] is t and t.device == device and torch.equal(t, value), name
    assert hooks == [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    assert getattr(model, "_torchoffload_weights", None) is None


def random_init():
    torch.manual_seed(123)
    return GPT(CFG).eval()


@pytest.mark.parametrize(
    ("missing", "resident"),
    [(("layers.1.fc1.weight",), ()), (("pos.weight",), ("pos",)),
     (tuple(f"layers.3.{m}.{p}" for m in ("ln1", "qkv", "proj", "ln2", "fc1", "fc2")
            for p in ("weight", "bias")), ())],  # a whole layer: a shard the index lacks
)  # fmt: skip
def test_a_real_model_with_tensors_the_checkpoint_lacks_is_refused(tmp_path, missing, resident):
    """A model built with random values and a checkpoint that lacks some of its tensors (another
    prefix, a shard missing from the index): a `CheckpointError` naming how many and the first
    few, before anything changes, as torch's ``load_state_dict`` (strict by default). Those
    tensors kept their random values silently."""
    state = {k: v for k, v in unique_state(reference()).items() if k not in missing}
    path = save(state, tmp_path / "model.safetensors")
    model = random_init()
    before = snapshot(model)
    shown = ", ".join(repr(n) for n in missing[:5])  # the first five, in the model's order
    message = (
        rf"{len(missing)} tensors? of the model .*not in the checkpoint.*{shown}.*strict=False"
    )
    with pytest.raises(CheckpointError, match=message):
        stream_weights(model, "cpu", budget_bytes=1 << 20, resident=resident, pin_memory=False,
                       checkpoint=path)  # fmt: skip
    assert_unchanged(model, before)
    handle = stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False)  # usable
    handle.remove()


@pytest.mark.parametrize("resident", [(), ("layers.1.fc1",)])
def test_strict_false_keeps_the_values_of_tensors_the_checkpoint_lacks(tmp_path, resident):
    """``strict=False``: a tensor the checkpoint lacks keeps its own values, as with torch's
    ``load_state_dict(strict=False)``; outputs bitwise that model's."""
    state = unique_state(reference())
    del state["layers.1.fc1.weight"]
    path = save(state, tmp_path / "model.safetensors")
    want = random_init()
    result = want.load_state_dict(state, strict=False)
    assert "layers.1.fc1.weight" in result.missing_keys  # (and head.weight: torch does not see
    # that it is tok.weight, which it loads)
    model = random_init()
    handle = stream_weights(model, "cpu", budget_bytes=1 << 20, resident=resident,
                            pin_memory=False, checkpoint=path, strict=False)  # fmt: skip
    with torch.no_grad():
        assert torch.equal(model(tokens()), want(tokens()))
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.state_dict().items())
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(tokens()), want(tokens()))
    model = on_meta()  # a tensor on meta has no values of its own to keep
    with pytest.raises(CheckpointError, match="'layers.1.fc1.weight'.*no values"):
        stream_weights(model, "cpu", budget_bytes=1 << 20, resident=resident,
                       pin_memory=False, checkpoint=path, strict=False)  # fmt: skip
    assert all(p.is_meta for p in model.parameters())


def test_entries_the_model_does_not_have_are_ignored(tmp_path):
    """Unexpected entries (an older Hugging Face checkpoint's ``rotary_emb.inv_freq``, another
    head) are ignored, strict or not, as Hugging Face does."""
    ref = reference()
    state = {**unique_state(ref), "rotary_emb.inv_freq": torch.arange(4.0),
             "classifier.weight": torch.ones(2, 64)}  # fmt: skip
    path = save(state, tmp_path / "model.safetensors")
    model = random_init()
    handle = stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=path)
    with torch.no_grad():
        assert torch.equal(model(tokens()), ref(tokens()))
    handle.remove()


@pytest.mark.parametrize("kept", ["tok.weight", "head.weight"])
def test_a_tied_weight_saved_under_one_of_its_names_is_not_missing(tmp_path, kept):
    ref = reference()
    state = dict(ref.state_dict())
    del state["head.weight" if kept == "tok.weight" else "tok.weight"]
    path = save(state, tmp_path / "model.safetensors")
    model = random_init()
    handle = stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False, checkpoint=path)
    with torch.no_grad():
        assert torch.equal(model(tokens()), ref(tokens()))
    handle.remove()
    assert model.head.weight is model.tok.weight


def test_non_persistent_buffers_and_empty_tensors_need_no_entry(tmp_path):
    """What ``state_dict()`` leaves out (a non-persistent buffer) and tensors with no elements
    are not required of a checkpoint."""
    torch.manual_seed(0)
    ref = WithBuffers().eval()
    path = save(ref.state_dict(), tmp_path / "buffers.safetensors")
    assert "table" not in ref.state_dict()
    torch.manual_seed(1)
    model = WithBuffers().eval()
    handle = stream_weights(model, "cpu", budget_bytes=1 << 20, unit="leaves", pin_memory=False,
                            checkpoint=path)  # fmt: skip
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    handle.remove()
    ref = WithEmpty().eval()
    path = save({"a.weight": ref.a.weight, "a.bias": ref.a.bias}, tmp_path / "e.safetensors")
    model = WithEmpty().eval()
    handle = stream_weights(model, "cpu", budget_bytes=1 << 20, unit="leaves", pin_memory=False,
                            checkpoint=path)  # fmt: skip
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    handle.remove()


def test_strict_is_checked_and_needs_a_checkpoint():
    """``strict=False`` without a checkpoint asks for nothing (no value is read): refused, as a
    likely mistake; ``strict`` must be a bool."""
    with pytest.raises(ValueError, match="strict=False.*checkpoint="):
        stream_weights(reference(), "cpu", budget_bytes=1 << 20, pin_memory=False, strict=False)
    with pytest.raises(TypeError, match="strict must be a bool"):
        stream_weights(reference(), "cpu", budget_bytes=1 << 20, pin_memory=False, strict=1)
    handle = stream_weights(reference(), "cpu", budget_bytes=1 << 20, pin_memory=False, strict=True)
    handle.remove()
