"""Step time of a layout: compute from FLOPs at a measured efficiency, communication per collective from
bytes, latency and link bandwidth (inside a node or across nodes), and the pipeline bubble.

FLOPs per step (Narayanan et al., 2021, with this model's shapes): forward 2 * (matmul params)
per token plus 4 s h per token and layer for attention; backward twice the forward; activation
checkpointing one more forward. Collectives follow the ring algorithm (plait.comm.accounting):
all-reduce 2 (n-1)/n B, all-gather and reduce-scatter (n-1)/n B, each step adding the latency.
Per step and device:

    data parallel    gradients all-reduced (ZeRO 1/2: reduce-scatter + all-gather, same volume;
                     ZeRO 3: one more all-gather); overlapped with backward by the profile's factor
    tensor parallel  4 all-reduces of b s h per layer and micro-batch (2 forward, 2 backward), plus
                     the profile's measured fixed cost of a tensor-parallel layer (DTensor dispatch);
                     outside the blocks (tp_outside_comm) the vocabulary-parallel embedding's all-reduce,
                     the head's all-gather of the logits and its input's all-reduce in backward (with
                     sequence parallel: the head's input all-gathered, reduce-scattered back, and the
                     first block's input gradient all-gathered)
    pipeline         2 sends of b s h per micro-batch and stage boundary; bubble (p-1)/m [/ v] of the busy
                     time, or less where ranks share cores (pipeline_time)
    expert parallel  per MoE layer and micro-batch 4 all-to-alls over ep ranks (dispatch and combine, forward
                     and backward; 6 under activation checkpointing) of the k b s h routed rows, each
                     (ep-1) steps of latency and (ep-1)/ep of its bytes on the link; the experts' gradients
                     all-reduced over their dp/ep replicas, the dense ones over dp
    optimizer        parameters the device updates x the profile's seconds per parameter (ZeRO 3:
                     plus the profile's measured fixed cost of a fully_shard layer; ZeRO 2 is one
                     fully_shard group, no per-layer hooks)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from plait.files import cache_dir
from plait.parallel.layout import Layout
from plait.plan.memory import Shape, predict_memory

PROFILE_PATH = cache_dir() / "device_profile.json"


@dataclass
class Hardware:
    """A device and its links; datasheet numbers unless a calibrated profile replaces them."""

    name: str = "datasheet"
    memory_bytes: float = 80e9
    flops: float = 989e12  # peak dense FLOP/s in the training dtype
    efficiency: float = 0.45  # achieved / peak on this model's matmuls
    intra_bw: float = 400e9 / 8  # bytes/s per direction inside a node
    inter_bw: float = 25e9 / 8  # bytes/s across nodes
    latency_s: float = 10e-6  # per collective step
    devices_per_node: int = 8
    overlap: float = 0.7  # share of data-parallel communication hidden behind backward
    optimizer_s_per_param: float = 2e-11  # AdamW update time per parameter (memory bound)
    cores: int = 0  # CPU cores the devices of a node share (calibrated CPU processes); 0: each device computes alone
    microbatch_overhead_s: float = 2e-4  # fixed cost of one forward + backward of the whole model (launches, Python)
    comm: dict = field(default_factory=dict)  # measured: "op/n" -> {"latency_s", "bw"} for n local ranks
    # measured fixed costs of a sharded layer beyond its compute and communication (plait.plan.calibrate):
    # {"tp": [s, s per sample], "tp_sp": [s, s per sample]} per layer and micro-batch, {"fsdp": s} per layer and step
    layer_overhead_s: dict = field(default_factory=dict)

    def save(self, path: Path = PROFILE_PATH) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path: Path = PROFILE_PATH) -> Hardware:
        return cls(**json.loads(Path(path).read_text()))

    def link(self, span: int) -> tuple[float, float]:
        """(latency, bandwidth) for a group whose ranks span `span` consecutive devices."""
        bw = self.intra_bw if span <= self.devices_per_node else self.inter_bw
        return self.latency_s, bw

    def collective(self, op: str, nbytes: float, n: int, span: int) -> float:
        """Seconds for one collective of `nbytes` over `n` ranks spanning `span` devices."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        measured = self.comm.get(f"{op}/{n}")
        if measured and span <= self.devices_per_node:
            return measured["latency_s"] + nbytes / measured["bw"]
        lat, bw = self.link(span)
        if op == "all_reduce":
            return 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw
        if op in ("all_gather", "reduce_scatter", "all_to_all"):
            return (n - 1) * lat + (n - 1) / n * nbytes / bw
        return lat + nbytes / bw  # send


def flops_per_step(shape: Shape, global_batch: int, activation_checkpointing: bool = False) -> float:
    """Model FLOPs of one training step (recomputation under activation checkpointing included when ac)."""
    tokens = global_batch * shape.context
    forward = tokens * (2 * shape.matmul_params + 4 * shape.context * shape.width * shape.layers)
    return forward * (4 if activation_checkpointing else 3)


def model_flops(shape: Shape, global_batch: int) -> float:
    """The FLOPs MFU counts: forward + backward, no recomputation."""
    return flops_per_step(shape, global_batch, activation_checkpointing=False)


def tp_outside_comm(shape: Shape, layout: Layout, hw: Hardware, elem: int = 4) -> float:
    """Seconds of tensor-parallel communication outside the blocks, per micro-batch, on the busiest pipeline
    stage: the tied (vocabulary-parallel) embedding's output all-reduced (first stage); the head's logits
    all-gathered and its input's gradient all-reduced, or with sequence parallel its input all-gathered and
    that gradient reduce-scattered, plus the first block's input gradient all-gathered (last stage)."""
    t = layout.tp
    act = elem * layout.micro_batch * shape.context * shape.width
    embed = hw.collective("all_reduce", act, t, t) if shape.tied else 0.0
    head = hw.collective("all_gather", elem * layout.micro_batch * shape.context * shape.vocab, t, t)
    if layout.sequence_parallel:
        head += hw.collective("all_gather", act, t, t) + hw.collective("reduce_scatter", act, t, t)
        embed += hw.collective("all_gather", act, t, t)
    else:
        head += hw.collective("all_reduce", act, t, t)
    return embed + head if layout.pp == 1 else max(embed, head)


def pipeline_time(busy: float, p: int, slots: int, ranks: int, cores: int = 0) -> float:
    """Seconds of a pipeline step whose ranks are each `busy` seconds busy (timed with all `ranks` of the host
    busy at once) in `slots` micro-batch slots (m v) over p stages.

    The schedule's wavefront takes slots + p - 1 slot times; in slot time k the stages s with
    0 <= k - s < slots work. With a device per rank (cores 0, or ranks <= cores) that is the bubble
    (p - 1) / slots. Where ranks share fewer cores, a waiting rank takes no CPU (gloo blocks in its
    receive), so a slot time in which a of the ranks work lasts max(1, a / cores) times a slot on a core
    of its own, against max(1, ranks / cores) when all of them work: while the pipeline fills and drains
    the busy stages get the idle ones' cores, and only cores left idle are bubble.
    """
    if p <= 1:
        return busy
    per_stage = ranks / p
    units = sum(_slowdown(per_stage * sum(0 <= k - s < slots for s in range(p)), cores) for k in range(slots + p - 1))
    return busy / slots / _slowdown(ranks, cores) * units


def _slowdown(working: float, cores: int) -> float:
    """How much longer a rank's work takes with `working` ranks on `cores` cores than on a core of its own."""
    return max(1.0, working / cores) if cores else 1.0


def predict_time(shape: Shape, layout: Layout, global_batch: int, hw: Hardware, elem: int = 4) -> dict:
    """Seconds per step split into compute, exposed data-parallel communication, tensor- and
    pipeline-parallel communication, bubble and optimizer; plus MFU. `elem`: bytes per element of
    the gradients and activations that travel (4 in fp32, 2 in 16-bit mixed precision)."""
    d, t, p, v = layout.dp, layout.tp, layout.pp, layout.virtual_stages
    m = global_batch // (d * layout.micro_batch)
    cp = layout.cp
    per_rank = shape.device_params(layout)
    busiest = max(per_rank)
    imbalance = busiest / (sum(per_rank) / p)  # the slowest stage sets the pace
    flops = flops_per_step(shape, global_batch, layout.activation_checkpointing)
    compute = flops / layout.devices / (hw.flops * hw.efficiency) * imbalance
    compute += hw.microbatch_overhead_s * m * v * (1 / p) * imbalance  # every micro-batch pays it, per stage
    ranks = min(layout.devices, hw.devices_per_node)  # that share a host's cores
    if hw.cores:  # timed with devices_per_node ranks on the cores: fewer ranks have a larger share each
        compute *= _slowdown(ranks, hw.cores) / _slowdown(hw.devices_per_node, hw.cores)
    backward = compute * (2 / 3 if not layout.activation_checkpointing else 2 / 4)
    act = elem * layout.micro_batch * shape.context * shape.width // cp  # one micro-batch's hidden states on this rank
    tp_span, dp_span = t, d * cp * t
    # context parallel: per block, K and V go round the ring in forward and again in backward (cp - 1 hops each),
    # and the dK/dV accumulators cp hops (float32); counted as exposed, although the ring posts each transfer before
    # the block's compute (benchmarks/context_parallel.py measures how much of it overlaps)
    cp_comm = 0.0
    if cp > 1:
        hop = hw.collective("send", 2 * act, 2, cp * t)
        cp_comm = (2 * (cp - 1) * hop + cp * hw.collective("send", 2 * 4 * act / elem, 2, cp * t)) * shape.layers * m
    tp_comm = 0.0
    if t > 1:
        per = hw.collective("all_reduce", act, t, tp_span)
        fixed, per_sample = hw.layer_overhead_s.get("tp_sp" if layout.sequence_parallel else "tp", (0.0, 0.0))
        extra = fixed + per_sample * layout.micro_batch
        tp_comm = (4 * per + extra) * (shape.layers / p) * m + tp_outside_comm(shape, layout, hw, elem) * m
    experts = shape.local_expert_params(layout)
    grad_bytes = elem * (busiest - experts)  # the dense part; the experts are averaged over their replicas only
    z = layout.zero
    ep_comm = 0.0
    if shape.moe_layers and layout.ep > 1:
        a2a = hw.collective("all_to_all", act * shape.top_k, layout.ep, layout.ep)
        ep_comm = (6 if layout.activation_checkpointing else 4) * a2a * shape.moe_layers * m
    d = layout.replicas  # gradients average over dp * cp ranks
    if d > 1:
        if z == 0:
            dp_comm = hw.collective("all_reduce", grad_bytes, d, dp_span)
        elif z == 1 and p > 1:  # ZeRO-1 in pipeline stages: the all-reduce, then each owner's broadcast of its update
            dp_comm = hw.collective("all_reduce", grad_bytes, d, dp_span) + hw.collective("all_gather", grad_bytes, d,
                                                                                             dp_span)
        else:
            dp_comm = hw.collective("reduce_scatter", grad_bytes, d, dp_span) + hw.collective("all_gather", grad_bytes, d,
                                                                                                  dp_span)
            if z == 3:
                dp_comm += hw.collective("all_gather", grad_bytes, d, dp_span) * (m if m > 1 else 1)
    else:
        dp_comm = 0.0
    dp_comm += hw.collective("all_reduce", elem * experts, d // layout.ep, dp_span)
    exposed_dp = max(0.0, dp_comm - hw.overlap * backward)
    pp_comm = 2 * m * v * hw.collective("send", act / (t if layout.sequence_parallel else 1), 2, d * t * 2) if p > 1 else 0.0
    bubble = 0.0
    if p > 1:
        bubble = pipeline_time(compute + tp_comm, p, m * v, ranks, hw.cores) - (compute + tp_comm)
    optimizer = hw.optimizer_s_per_param * ((busiest - experts) / (d if z >= 1 else 1) + experts)
    if d > 1 and z == 3:  # fully_shard's hooks and copies, per layer (ZeRO-2 is one group for the whole model)
        optimizer += hw.layer_overhead_s.get("fsdp", 0.0) * shape.layers / p
    step = compute + tp_comm + pp_comm + ep_comm + cp_comm + bubble + exposed_dp + optimizer
    return {
        "step_s": step, "compute_s": compute, "tp_comm_s": tp_comm, "pp_comm_s": pp_comm, "ep_comm_s": ep_comm,
        "cp_comm_s": cp_comm,
        "bubble_s": bubble,
        "dp_comm_s": dp_comm, "dp_exposed_s": exposed_dp, "optimizer_s": optimizer,
        "mfu": model_flops(shape, global_batch) / (step * layout.devices * hw.flops) if step > 0 else 0.0,
    }


def predict(shape: Shape, layout: Layout, global_batch: int, hw: Hardware, optimizer_k: int = 8) -> dict:
    mem = predict_memory(shape, layout, global_batch, optimizer_k)
    return {"layout": layout, "memory": mem, "time": predict_time(shape, layout, global_batch, hw),
            "fits": mem["total"] <= hw.memory_bytes}
