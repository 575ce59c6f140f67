"""The training loop: the strategy steps, the callbacks decide, telemetry measures, the checkpointer saves.

    summary = run(build_job(cfg, run_dir))    # plait.train.build makes the job; train() does both

It knows nothing about layouts or features: the step is the strategy's (plait.parallel), the learning
rate, freezing, batch shares, early stopping and the best checkpoint are callbacks (plait.train.callbacks),
and everything the run measures about itself is plait.train.telemetry's.
"""

from __future__ import annotations

from plait.callback import Decision
from plait.train.build import Job


def run(job: Job) -> dict:
    """Train from job.start to job.stop (or an early stop, or a preemption); returns the summary."""
    s, tel, cbs, ckpt = job.strategy, job.telemetry, job.callbacks, job.checkpointer
    step, saved_at, preempted, clip = job.start, job.start, False, job.cfg.optim.grad_clip
    s.model.train()
    batches = iter(job.loader)
    try:
        with tel:
            tel.note(cbs.on_train_begin(step))
            while step < job.stop:
                with tel.between_steps():  # freezing (and DDP's rebuild) stays out of the step's time
                    tel.note(cbs.on_step_begin(step))
                tel.begin(step + 1)
                with tel.phase("data"):  # prepared ahead by the loader's thread: this is the wait + copy
                    micro = job.to_device(next(batches))
                with tel.phase("forward_backward") as compute:
                    loss = s.forward_backward(micro)
                    cbs.after_compute(step, compute.seconds(), sum(len(x) for x, _ in micro))
                with tel.phase("optimizer"):
                    grad_norm = s.clip_grad_norm(clip, need_norm=tel.logs(step + 1))
                    s.optimizer_step()
                step += 1
                tel.note(cbs.on_step_end(step))
                preempted = tel.end(step, loss, grad_norm)
                decision = Decision(save=preempted or job.checkpoint_due(step), stop=preempted)
                if not preempted and job.evaluation_due(step):  # before the save: it holds what the evaluation decided
                    decision = decision | cbs.on_eval(step, tel.evaluate(step))
                if decision.save and ckpt is not None:
                    job.save(step)
                    saved_at = step
                if decision.mark_best and ckpt is not None:
                    ckpt.mark_best(step)
                tel.note(list(decision.events))
                if decision.stop:
                    break
            if ckpt is not None:
                ckpt.finish()
    finally:
        batches.close()
    summary = tel.preempted(step, saved_at) if preempted else tel.finish(step, cbs)
    if not preempted:
        cbs.on_train_end(step, ckpt)
    s.finish()
    return summary
