"""Tensor parallel layer by layer, in the manner of picotron's tests: every sharded piece against its
single-process twin, on output and on every gradient.

Each pool task builds the reference and the sharded copy from the same seed on both ranks, applies
the styles that GPT.tp_plan declares (plait.parallel.tp.apply_tp for the whole model, the single plan
entry for a lone layer), and returns the max abs difference of every compared tensor: outputs and
input gradients gathered from the ranks' pieces, parameter gradients as DTensor.full_tensor() and,
after align_grads, as the local piece the optimizer steps on. The tests then name what differs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

TOL = 1e-5
V, T, W, HEADS, B = 16, 8, 16, 2, 2  # vocabulary, sequence, width, heads, batch


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _is_dtensor(t) -> bool:
    return hasattr(t, "full_tensor")


def _piece(t: torch.Tensor, layout: str) -> torch.Tensor:
    """This rank's piece of a full tensor: `full` (replicated), `col` (last dim split), `seq` (dim 1 split)."""
    if layout == "full":
        return t
    return t.chunk(2, -1 if layout == "col" else 1)[dist.get_rank()]


def _gather(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The full tensor from every rank's piece (a DTensor knows its own layout)."""
    if _is_dtensor(t):
        return t.full_tensor()
    if layout == "full":
        return t
    parts = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, -1 if layout == "col" else 1)


def _local_piece_of(full: torch.Tensor, placements) -> torch.Tensor:
    """What a DTensor with `placements` holds on this rank of a 1-D mesh of 2 (torch.chunk, as Shard does)."""
    from torch.distributed.tensor import Shard

    (p,) = placements
    return full.chunk(2, p.dim)[dist.get_rank()] if isinstance(p, Shard) else full


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    return float((a.detach() - b.detach()).abs().max())


def _perturb(module: nn.Module) -> None:
    """LayerNorm weights of 1 and zero biases would hide a bias or LayerNorm-weight gradient gone missing."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))


def _param_grads(tp: nn.Module, ref: nn.Module, out: dict, problems: list) -> None:
    """Every parameter's gradient: full tensor, then (after align_grads) the local piece and its placements."""
    from plait.parallel.gradsync import align_grads

    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in tp.named_parameters()]
    if set(names) != set(ref_params):
        problems.append(f"parameter names: extra {sorted(set(names) - set(ref_params))}, "
                        f"missing {sorted(set(ref_params) - set(names))}")
    for name, p in tp.named_parameters():
        if name not in ref_params:  # reported above (e.g. a tied weight split in two)
            continue
        if p.grad is None:
            problems.append(f"{name}: no gradient")
            continue
        g = p.grad.full_tensor() if _is_dtensor(p.grad) else p.grad
        out[f"grad:{name}"] = _diff(g, ref_params[name].grad)
    align_grads(tp.parameters())
    for name, p in tp.named_parameters():
        if p.grad is None or not _is_dtensor(p) or name not in ref_params:
            continue
        if tuple(p.grad.placements) != tuple(p.placements):
            problems.append(f"{name}: gradient placements {p.grad.placements} != parameter's {p.placements}")
            continue
        out[f"local-grad:{name}"] = _diff(p.grad.to_local(), _local_piece_of(ref_params[name].grad, p.placements))


# ---------------------------------------------------------------- the whole tiny GPT, sublayer by sublayer

def _expected_layouts(sp: bool, layers: int) -> dict[str, str]:
    """Where each sublayer's output lives on a rank: full, col (last dim split), seq / dseq (sequence split,
    as a plain local tensor / as a DTensor Shard(1))."""
    rows = "seq" if sp else "full"
    ln = "dseq" if sp else "full"
    want = {"tok_emb": "full", "pos_emb": "full", "ln_f": ln, "head": "full"}
    for i in range(layers):
        b = f"blocks.{i}"
        want.update({f"{b}.ln1": ln, f"{b}.attn.q": "col", f"{b}.attn.k": "col", f"{b}.attn.v": "col",
                     f"{b}.attn.proj": rows, f"{b}.attn": rows, f"{b}.ln2": ln, f"{b}.mlp.up": "col",
                     f"{b}.mlp.down": rows, f"{b}.mlp": rows, b: rows})
    return want


def gpt_check(sp: bool, tied: bool, layers: int = 2) -> dict:
    """Pool task: a tiny GPT and its tensor-parallel copy; diffs of every sublayer output, the logits, the loss
    and every parameter gradient, plus a list of layout problems."""
    from torch.distributed.tensor import Shard

    from plait.models.gpt import GPT
    from plait.parallel.tp import apply_tp

    torch.manual_seed(0)
    ref = GPT(V, T, W, HEADS, layers, tie_embeddings=tied)
    _perturb(ref)
    tp = apply_tp(copy.deepcopy(ref), _mesh(), sp)
    idx = torch.randint(0, V, (B, T))
    y = torch.randint(0, V, (B, T))

    want = _expected_layouts(sp, layers)
    seen: dict[str, dict] = {"ref": {}, "tp": {}}
    for tag, model in (("ref", ref), ("tp", tp)):
        for name in want:
            model.get_submodule(name).register_forward_hook(
                lambda mod, args, output, name=name, tag=tag: seen[tag].__setitem__(name, output.detach()))

    ref_logits = ref(idx)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, V), y.reshape(-1))
    ref_loss.backward()
    logits = tp(idx)
    loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    loss.backward()

    out: dict[str, float] = {}
    problems: list[str] = []
    out["logits"] = _diff(_gather(logits, "full"), ref_logits)
    out["loss"] = abs(float(loss.detach()) - float(ref_loss.detach()))
    for name, layout in want.items():  # the same order on both ranks: the gathers are collectives
        got, expect = seen["tp"][name], seen["ref"][name]
        if layout == "dseq":
            if not _is_dtensor(got) or tuple(got.placements) != (Shard(1),):
                problems.append(f"{name}: output {type(got).__name__} {getattr(got, 'placements', '')}, want DTensor Shard(1)")
                continue
        elif _is_dtensor(got) or got.shape != _piece(expect, layout).shape:
            problems.append(f"{name}: output {type(got).__name__} {tuple(got.shape)}, want a plain local {layout} piece "
                            f"{tuple(_piece(expect, layout).shape)}")
            continue
        out[f"out:{name}"] = _diff(_gather(got, layout), expect)

    if tied and tp.head.weight is not tp.tok_emb.weight:
        problems.append("head.weight and tok_emb.weight are no longer the same parameter after apply_tp")
    if not tied and tp.head.weight is tp.tok_emb.weight:
        problems.append("untied head and tok_emb share a parameter")
    _param_grads(tp, ref, out, problems)
    return {"diffs": out, "problems": problems}


def _bad(diffs: dict) -> dict:
    return {k: v for k, v in diffs.items() if not v <= TOL}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tiny_gpt_matches_reference_sublayer_by_sublayer(pool2, sp, tied):
    results = pool2.run(gpt_check, sp, tied)
    from plait.models.gpt import GPT

    ref = GPT(V, T, W, HEADS, 2, tie_embeddings=tied)
    params = {n for n, _ in ref.named_parameters()}
    sharded = {n for n, _ in ref.named_parameters() if n.split(".")[-2] in ("q", "k", "v", "proj", "up", "down")}
    sharded |= {"tok_emb.weight"} if tied else {"head.weight"}  # tied: one parameter, named tok_emb.weight
    if sp:
        sharded |= {n for n in params if ".ln" in n or n.startswith("ln")}
    for rank, r in enumerate(results):
        assert r["problems"] == [], f"rank {rank}"
        diffs = r["diffs"]
        # nothing skipped: every sublayer output, every gradient, every sharded gradient's local piece
        assert {k[4:] for k in diffs if k.startswith("out:")} == set(_expected_layouts(sp, 2))
        assert {k[5:] for k in diffs if k.startswith("grad:")} == params
        assert {k[11:] for k in diffs if k.startswith("local-grad:")} == sharded
        assert _bad(diffs) == {}, f"rank {rank}: beyond {TOL}"


# ---------------------------------------------------------------- one layer at a time, with its plan entry

# plan entry -> (module factory, input layout on a rank, output layout on a rank)
LAYERS = {
    "blocks.0.attn.q": (lambda: nn.Linear(W, W), "full", "col"),          # column parallel
    "blocks.0.mlp.up": (lambda: nn.Linear(W, 4 * W), "full", "col"),      # column parallel
    "blocks.0.attn.proj": (lambda: nn.Linear(W, W), "col", None),         # row parallel (None: full, or seq with sp)
    "blocks.0.mlp.down": (lambda: nn.Linear(4 * W, W), "col", None),      # row parallel
    "tok_emb": (lambda: nn.Embedding(V, W), "ids", "full"),               # vocabulary parallel (tied embedding)
    "head": (lambda: nn.Linear(W, V, bias=False), None, "full"),          # column parallel over the vocabulary
    "blocks.0.ln1": (lambda: nn.LayerNorm(W), "seq", "dseq"),             # sequence parallel (sp only)
    "ln_f": (lambda: nn.LayerNorm(W), "seq", "dseq"),                     # sequence parallel (sp only)
}


def layer_check(entry: str, sp: bool) -> dict:
    """Pool task: one module parallelized with GPT.tp_plan(sp)[entry] against its copy; output, input gradient and
    parameter gradients for a loss sum(out * R) whose pieces add up, over the ranks, to the reference's."""
    from torch.distributed.tensor.parallel import parallelize_module

    from plait.models.gpt import GPT

    make, in_layout, out_layout = LAYERS[entry]
    in_layout = in_layout or ("seq" if sp else "full")
    out_layout = out_layout or ("seq" if sp else "full")
    style = GPT(V, T, W, HEADS, 1).tp_plan(sp)[entry]

    torch.manual_seed(1)
    ref = make()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    tp = parallelize_module(copy.deepcopy(ref), _mesh(), style)

    if in_layout == "ids":
        x = torch.randint(0, V, (B, T))
        x_local = x
    else:
        x = torch.randn(B, T, ref.weight.shape[-1], requires_grad=True)
        x_local = _piece(x.detach(), in_layout).clone().requires_grad_(True)
    ref_out = ref(x)
    r = torch.randn_like(ref_out)
    (ref_out * r).sum().backward()

    got = tp(x_local)
    out: dict[str, float] = {}
    problems: list[str] = []
    if out_layout == "dseq":
        if not _is_dtensor(got):
            problems.append(f"output is {type(got).__name__}, want a DTensor")
            got_local = got
        else:
            got_local = got.to_local()
        local_r = _piece(r, "seq")
    else:
        if _is_dtensor(got):
            problems.append(f"output is a DTensor {got.placements}, want a plain local tensor")
            got = got.to_local()
        got_local = got
        local_r = _piece(r, out_layout)
    if got_local.shape != local_r.shape:
        problems.append(f"local output {tuple(got_local.shape)}, want {tuple(local_r.shape)} ({out_layout})")
        return {"diffs": out, "problems": problems}
    out["out"] = _diff(_gather(got_local, "seq" if out_layout == "dseq" else out_layout), ref_out)
    (got_local * local_r).sum().backward()
    if in_layout != "ids":
        out["input-grad"] = _diff(x_local.grad, _piece(x.grad, in_layout))
    _param_grads(tp, ref, out, problems)
    return {"diffs": out, "problems": problems}


@pytest.mark.parametrize("entry, sp", [
    ("blocks.0.attn.q", False), ("blocks.0.mlp.up", False),
    ("blocks.0.attn.proj", False), ("blocks.0.attn.proj", True),
    ("blocks.0.mlp.down", False), ("blocks.0.mlp.down", True),
    ("tok_emb", False), ("tok_emb", True),
    ("head", False), ("head", True),
    ("blocks.0.ln1", True), ("ln_f", True),
])
def test_one_layer_with_its_plan_entry_matches_its_reference(pool2, entry, sp):
    results = pool2.run(layer_check, entry, sp)
    n_params = len(list(LAYERS[entry][0]().parameters()))
    for rank, r in enumerate(results):
        assert r["problems"] == [], f"rank {rank}"
        diffs = r["diffs"]
        assert "out" in diffs and sum(k.startswith("grad:") for k in diffs) == n_params
        assert sum(k.startswith("local-grad:") for k in diffs) == n_params  # every parameter is a DTensor
        assert ("input-grad" in diffs) == (entry != "tok_emb")
        assert _bad(diffs) == {}, f"rank {rank}: beyond {TOL}"
