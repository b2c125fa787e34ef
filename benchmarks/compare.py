#!/usr/bin/env python3
"""Sets microbatch's benchmark results beside PyTorch's and checks them against the issue's targets.

Reads, from DIR (the files scripts/gpu_check.sh writes; a missing one is reported and skipped, one
that is empty, cut short or not a JSON object is reported as unreadable and counts as failed):
  kernels.json        bench_kernels_cuda        torch_kernels.json   benchmarks/torch_kernels.py
  gpt2.json           bench_gpt2_cuda           torch_gpt2.json      benchmarks/torch_gpt2.py
  gpt2_simt.json      bench_gpt2_cuda rerun on the f32-math attention (MB_ATTENTION_KERNEL=simt)
  planner.json        benchmarks/planner_cuda.sh
  attention.json      bench_attention_cuda      torch_attention.json benchmarks/torch_attention.py
  image_mlp.json      bench_image_cuda          torch_image_mlp.json benchmarks/torch_image.py
  image_cnn.json      bench_image_cuda          torch_image_cnn.json benchmarks/torch_image.py

Targets (memory-bound kernels, as a fraction of the device's copy bandwidth, Note [Bytes moved] in
benchmarks/kernels_cuda.cpp): accumulate >= 0.90, AdamW >= 0.85 and no slower than PyTorch's fused
AdamW, gradient norm >= 0.80, softmax + cross-entropy forward and backward >= 0.80; and each kernel
must agree with the CPU reference. GPT-2, at each micro-batch: both runs start from the same weights
and tokens, so their first losses must agree within 0.02 and every step's within 0.05 (bf16
rounding); the median step time and the peak allocated memory must be no more than PyTorch's
(max_memory_allocated); a run that failed, or that the file lists but has no result for, fails.
gpt2_simt.json, where the check wrote one (the tensor-core run measured nothing), is compared the
same way, beside gpt2.json's failures. Planner: the measured peak must stay within the budget and
the predicted one within 5% of it. The Fashion-MNIST models (image_*.json, from the CPU
comparison; not missed when absent) are compared as GPT-2 is, in f32: first losses within 1e-4,
every step's within 1e-3, step time and peak memory no more than PyTorch's. A target whose PyTorch
figure is missing (a PyTorch run that failed; its peak memory on the CPU) is shown as "-" and named
as not checked. Attention (ours /
PyTorch SDPA time, and how far our two kernels are apart) has no target: it changes no outcome.
Neither has memory on the CPU, where PyTorch keeps no allocator statistics: where both runs
recorded the growth of their process's resident memory (host_rss_growth_bytes), it is shown below
the run's row and plotted in place of the allocator's peak.

  python3 benchmarks/compare.py DIR [--json PATH] [--plots PLOTDIR]
      exit status 1 when a target or a check fails. --json writes the summary as standard JSON (a
      figure that is not finite as null). --plots also draws the results as SVG files in PLOTDIR
      (gpt2_loss, gpt2_step, image_<model>_loss, image_<model>_step, kernels, attention and
      planner .svg, each skipped when its files are missing; drawn by benchmarks/svg_plot.py, no
      matplotlib); the plots change no outcome.
"""
import argparse
import json
import math
import os
import sys

from svg_plot import Figure, bar_panel, finite, line_panel

FIRST_LOSS_TOLERANCE = 0.02  # the same weights and tokens: only the forward's bf16 rounding differs
# Every step's loss: each side's bf16 rounding of the gradients then steers AdamW (whose update is
# about lr per element, whatever the gradient's size) apart, step after step. 0.05 is the bound
# llm.c's test_gpt2.cu holds its bf16 build to over 10 steps against PyTorch: on losses near 11
# (ln 50257), a little above the 0.03 of half a bf16 spacing there, far below a real divergence.
LOSS_TOLERANCE = 0.05
# The Fashion-MNIST models (f32 on both sides, the same weights and images): the first loss differs
# by the order of f32 sums alone; later ones by that order's effect carried through AdamW's steps.
IMAGE_FIRST_LOSS_TOLERANCE = 1e-4
IMAGE_LOSS_TOLERANCE = 1e-3
PREDICTION_TOLERANCE = 0.05  # the planner's predicted peak, as a fraction of the measured one
TIME_TARGETS = ("adamw",)
IMAGE_MODELS = ("mlp", "cnn")  # image_<model>.json from bench_image_cuda, torch_image_<model>.json  # kernels that must also take no longer than PyTorch's counterpart


def load(directory, name, unreadable, missing_note=True):
    """The JSON object in DIR/NAME, else None: a missing file is skipped, an unreadable one (a stage
    killed while writing it) is said and added to UNREADABLE, to count as failed."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        if missing_note:
            print(f"  ({name}: not found, skipped)")
        return None
    try:
        with open(path) as f:
            j = json.load(f)
        why = None if isinstance(j, dict) else "not a JSON object"
    except (OSError, ValueError) as e:  # a decoding error is a ValueError too
        why = f"{type(e).__name__}: {e}"
    if why:
        print(f"  ({name}: unreadable, counted as failed: {why})")
        unreadable.append(name)
        return None
    return j


def ratio(a, b):
    a, b = finite(a), finite(b)
    return a / b if a and b else None


def fmt(x, spec):
    # The benchmarks write a figure that is not finite as null (PyTorch's side as NaN).
    x = finite(x)
    return "-" if x is None else format(x, spec)


def mib(x):
    x = finite(x)
    return None if x is None else x / 2**20


def dicts(xs):
    """The entries of a JSON list that are objects: a null list or a null entry is passed over."""
    return [x for x in xs if isinstance(x, dict)] if isinstance(xs, list) else []


def no_more_than(ours, theirs):
    """OURS <= THEIRS; None (not checked) when PyTorch has no figure. A missing figure of ours fails."""
    ours, theirs = finite(ours), finite(theirs)
    if theirs is None:
        return None
    return ours is not None and ours <= theirs


def standard(x):
    """X with every number that is not finite as None: json.dump would write NaN, which is not JSON."""
    if isinstance(x, dict):
        return {k: standard(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [standard(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def compare_kernels(ours, torch_, summary):
    print("\nMemory-bound kernels: GB/s and the fraction of the copy bandwidth (higher is better); "
          "time ratio ours/PyTorch (lower is better)")
    theirs = {k.get("name"): k for k in dicts((torch_ or {}).get("kernels"))}
    copy_ours = ours.get("copy_gb_per_s")
    copy_theirs = (torch_ or {}).get("copy_gb_per_s")
    print(f"  copy bandwidth: ours {fmt(copy_ours, '.1f')} GB/s, PyTorch {fmt(copy_theirs, '.1f')} GB/s "
          f"on {ours.get('device')} ({ours.get('sizes')} sizes)")
    print(f"  {'kernel':<30}{'ours ms':>10}{'GB/s':>9}{'vs copy':>9}{'target':>8}  {'result':<8}"
          f"{'torch ms':>10}{'vs copy':>9}{'ours/torch':>11}")
    ok = True
    notes = []
    for k in dicts(ours.get("kernels")):
        name = str(k.get("name"))
        t = theirs.get(k.get("name"), {})
        target = k.get("target")
        meets = k.get("meets_target", True)
        # AdamW's second target: no slower than torch.optim.AdamW(fused=True).
        faster = no_more_than(k.get("median_ms"), t.get("median_ms")) if name in TIME_TARGETS else None
        if name in TIME_TARGETS:
            notes.append(f"  {name}: time no more than PyTorch's: " + (
                "not checked (no PyTorch figure)" if faster is None else
                f"{'pass' if faster else 'FAIL'} ({fmt(k.get('median_ms'), '.4f')} ms, "
                f"PyTorch {fmt(t.get('median_ms'), '.4f')} ms)"))
        if not k.get("checked", False):
            result = "WRONG"
        elif faster is False:
            result = "FAIL"
        elif target is None:
            result = "-"
        else:
            result = "pass" if meets else "FAIL"
        ok = ok and k.get("checked", False) and meets and faster is not False
        time_ratio = ratio(k.get("median_ms"), t.get("median_ms"))
        print(f"  {name:<30}{fmt(k.get('median_ms'), '.4f'):>10}{fmt(k.get('gb_per_s'), '.1f'):>9}"
              f"{fmt(k.get('ratio_to_copy'), '.3f'):>9}"
              f"{fmt(target, '.2f'):>8}  {result:<8}{fmt(t.get('median_ms'), '.4f'):>10}"
              f"{fmt(t.get('ratio_to_copy'), '.3f'):>9}{fmt(time_ratio, '.3f'):>11}")
        summary["kernels"][name] = dict(ours_ms=k.get("median_ms"),
                                        ours_ratio_to_copy=k.get("ratio_to_copy"),
                                        target=target, result=result, torch_ms=t.get("median_ms"),
                                        time_ratio_ours_over_torch=time_ratio)
        if name in TIME_TARGETS:
            summary["kernels"][name]["no_slower_than_torch"] = faster
            if faster is None:
                summary["not_checked"].append(f"kernels: {name} time against PyTorch's")
    # A kernel whose run threw has no row above; its target counts as missed.
    for e in dicts(ours.get("errors")):
        name = str(e.get("name"))
        print(f"  {name:<30}  failed: {e.get('error')}")
        summary["kernels"][name] = dict(result="failed", error=e.get("error"))
        ok = False
    # bench_kernels_cuda rewrites its JSON after every kernel: "complete": false is a run cut short,
    # whose later kernels were never measured (files from before the field have none: complete).
    if ours.get("complete", True) is False:
        print("  the run was cut short: the kernels after the last one above were not measured")
        summary["kernels"]["(run cut short)"] = dict(result="failed")
        ok = False
    for n in notes:
        print(n)
    return ok


class Training:
    """What sets one training benchmark apart from another in the comparison: its name in titles,
    its rate (the JSON key and the column's unit) and how closely the two runs' losses must agree."""

    def __init__(self, name, rate_key, rate_unit, first_tolerance, loss_tolerance):
        self.name, self.rate_key, self.rate_unit = name, rate_key, rate_unit
        self.first_tolerance, self.loss_tolerance = first_tolerance, loss_tolerance


GPT = Training("GPT", "tokens_per_s", "tok/s", FIRST_LOSS_TOLERANCE, LOSS_TOLERANCE)
# The Fashion-MNIST models train in f32 on both sides: their losses differ only by the order of f32
# sums, whose effect AdamW carries from step to step; IMAGE_LOSS_TOLERANCE bounds the drift.
IMAGE = Training("Fashion-MNIST", "samples_per_s", "img/s", IMAGE_FIRST_LOSS_TOLERANCE,
                 IMAGE_LOSS_TOLERANCE)


def compare_training(ours, torch_, summary, key="gpt2", label="", kind=GPT):
    where = f", {ours['device']}" if ours.get("device") else ""
    attention = f", attention {ours['attention']}" if ours.get("attention") else ""
    unit = kind.rate_unit
    print(f"\n{kind.name} training step{label} ({ours.get('model')}, {ours.get('parameters')} parameters{where}{attention}): "
          "ours / PyTorch — step time and memory lower is better (the targets: no more than PyTorch's), "
          f"{unit} higher is better")
    theirs = {r.get("batch"): r for r in dicts((torch_ or {}).get("runs"))}
    print(f"  {'batch':>5}{'ours ms':>10}{'torch ms':>10}{'ours ' + unit:>12}{'torch ' + unit:>12}{unit + ' ratio':>12}"
          f"{'ours MiB':>10}{'torch MiB':>11}{'mem ratio':>10}{'loss[0] ours':>14}{'torch':>9}{'max |dloss|':>12}  result")
    ok = True
    out = summary[key]
    if ours.get("error"):
        print(f"  failed before any run: {ours['error']}")
        out["error"] = ours["error"]
        ok = False
    runs = dicts(ours.get("runs"))
    # A batch size the run was given but left no result for: killed at its time box.
    done = [r.get("batch") for r in runs]
    for b in ours.get("batches") if isinstance(ours.get("batches"), list) else []:
        if b not in done and not ours.get("error"):
            runs.append({"batch": b, "error": "no result (the run did not finish)"})
    for r in runs:
        if r.get("error"):
            print(f"  {str(r.get('batch')):>5}  failed: {r['error']}")
            out[str(r.get("batch"))] = dict(result="failed", error=r["error"])
            ok = False
            continue
        t = theirs.get(r.get("batch"), {})
        fails = []
        max_diff = None
        # A loss that was not finite is written as null (NaN on PyTorch's side): it agrees with
        # nothing, at the first step or any other.
        ours_losses = r.get("losses") if isinstance(r.get("losses"), list) else []
        torch_losses = t.get("losses") if isinstance(t.get("losses"), list) else []
        first = finite((ours_losses or [None])[0])
        first_torch = finite((torch_losses or [None])[0])
        losses_ok = None
        if torch_losses:
            pairs = [(finite(x), finite(y)) for x, y in zip(ours_losses, torch_losses)]
            diffs = [abs(x - y) for x, y in pairs if x is not None and y is not None]
            max_diff = max(diffs) if diffs else None
            if first is None or first_torch is None or abs(first - first_torch) > kind.first_tolerance:
                fails.append("first losses differ")
            if not pairs or len(diffs) < len(pairs) or max_diff > kind.loss_tolerance:
                fails.append(f"losses differ by more than {kind.loss_tolerance}")
            losses_ok = not fails
        faster = no_more_than(r.get("step_ms_median"), t.get("step_ms_median"))
        smaller = no_more_than(r.get("peak_allocated_bytes"), t.get("peak_allocated_bytes"))
        if faster is False:
            fails.append("slower than PyTorch")
        if smaller is False:
            fails.append("more memory than PyTorch")
        unchecked = [what for what, held in (("losses", losses_ok), ("step time", faster),
                                             ("peak memory", smaller)) if held is None]
        for what in unchecked:
            summary["not_checked"].append(f"{key}: micro-batch {r.get('batch')} {what} against PyTorch's")
        ok = ok and not fails
        if fails:
            result = f"FAIL ({', '.join(fails)})"
        elif len(unchecked) == 3:
            result = "-"  # no PyTorch run to compare with
        else:
            result = "pass" + (f" (not checked: {', '.join(unchecked)})" if unchecked else "")
        tok_ratio = ratio(r.get(kind.rate_key), t.get(kind.rate_key))
        mem_ratio = ratio(r.get("peak_allocated_bytes"), t.get("peak_allocated_bytes"))
        print(f"  {str(r.get('batch')):>5}{fmt(r.get('step_ms_median'), '.1f'):>10}"
              f"{fmt(t.get('step_ms_median'), '.1f'):>10}{fmt(r.get(kind.rate_key), '.0f'):>12}"
              f"{fmt(t.get(kind.rate_key), '.0f'):>12}{fmt(tok_ratio, '.3f'):>12}"
              f"{fmt(mib(r.get('peak_allocated_bytes')), '.0f'):>10}{fmt(mib(t.get('peak_allocated_bytes')), '.0f'):>11}"
              f"{fmt(mem_ratio, '.3f'):>10}{fmt(first, '.4f'):>14}"
              f"{fmt(first_torch, '.4f'):>9}"
              f"{fmt(max_diff, '.4f'):>12}  {result}")
        host = host_memory(r, t)
        if host:
            print(f"  {'':>5}  on the CPU, resident memory's growth over the run (no target): ours "
                  f"{fmt(mib(host[0]), '.1f')} MiB, PyTorch {fmt(mib(host[1]), '.1f')} MiB, ratio "
                  f"{fmt(ratio(*host), '.3f')}")
        out[str(r.get("batch"))] = dict(
            ours_host_rss_growth=host[0] if host else None, torch_host_rss_growth=host[1] if host else None,
            host_memory_ratio=ratio(*host) if host else None,
            ours_step_ms=r.get("step_ms_median"), torch_step_ms=t.get("step_ms_median"),
            **{f"ours_{kind.rate_key}": r.get(kind.rate_key), f"torch_{kind.rate_key}": t.get(kind.rate_key),
               f"{kind.rate_key}_ratio": tok_ratio},
            ours_peak_allocated=r.get("peak_allocated_bytes"), torch_peak_allocated=t.get("peak_allocated_bytes"),
            memory_ratio=mem_ratio, first_loss_ours=first, first_loss_torch=first_torch,
            max_loss_difference=max_diff, losses_agree=losses_ok, no_slower_than_torch=faster,
            no_more_memory_than_torch=smaller, result=result)
    return ok


def host_memory(r, t):
    """(ours, PyTorch's) growth of resident memory over a CPU run, or None unless both recorded
    one: PyTorch keeps no allocator statistics on the CPU, so both sides' processes are measured
    alike (host_rss_growth_bytes: the peak over the steps less the size before the model)."""
    pair = tuple(finite(x.get("host_rss_growth_bytes")) for x in (r, t))
    return pair if None not in pair else None


def attention_figures(j):
    return {key: j.get(key) for key in ("forward_ms", "forward_backward_ms", "forward_tflops",
                                        "forward_backward_tflops")}


def compare_attention(ours, torch_, summary):
    shape = ours.get("shape")
    print(f"\nCausal attention {tuple(shape or ())} bf16 on {ours.get('device')}: ms lower is "
          "better, TFLOP/s higher is better; time ratio ours/PyTorch SDPA (lower is better)")
    theirs = torch_ or {}
    if theirs and theirs.get("shape") != shape:
        print(f"  (PyTorch ran {tuple(theirs.get('shape') or ())}: no ratios)")
        theirs = {}
    print(f"  {'kernel':<24}{'fwd ms':>9}{'TFLOP/s':>9}{'ours/torch':>11}"
          f"{'fwd+bwd ms':>12}{'TFLOP/s':>9}{'ours/torch':>11}")
    out = {}
    # A file from before there were two kernels names none.
    ours_label = "ours, tensor cores" if ours.get("kernel") == "tensor" else "ours"
    for label, key, j in [(ours_label, "ours", ours),
                          ("ours, f32 math (simt)", "simt", ours.get("simt")),
                          ("PyTorch SDPA", "torch", torch_)]:
        if j is None:
            continue
        if j.get("error"):
            print(f"  {label:<24}failed: {j['error']}")
            out[key] = dict(error=j["error"])
            continue
        f = attention_figures(j)
        out[key] = f
        fwd_ratio = fb_ratio = None
        if key != "torch":
            fwd_ratio = ratio(f["forward_ms"], theirs.get("forward_ms"))
            fb_ratio = ratio(f["forward_backward_ms"], theirs.get("forward_backward_ms"))
            f.update(forward_time_ratio_ours_over_torch=fwd_ratio,
                     forward_backward_time_ratio_ours_over_torch=fb_ratio)
        print(f"  {label:<24}{fmt(f['forward_ms'], '.3f'):>9}{fmt(f['forward_tflops'], '.1f'):>9}"
              f"{fmt(fwd_ratio, '.3f'):>11}{fmt(f['forward_backward_ms'], '.3f'):>12}"
              f"{fmt(f['forward_backward_tflops'], '.1f'):>9}{fmt(fb_ratio, '.3f'):>11}")
    agreement = ours.get("tensor_vs_simt")
    if agreement is not None:
        tolerance = ours.get("tensor_vs_simt_tolerance")
        out["tensor_vs_simt"] = dict(agreement, tolerance=tolerance)
        if agreement.get("error"):
            print(f"  tensor cores vs simt: the comparison failed: {agreement['error']}")
        else:
            # The benchmark writes a difference that is not finite (a kernel's NaNs) as null.
            order = ["out", "dq", "dk", "dv"]  # the JSON's keys come sorted
            names = sorted(agreement, key=lambda n: order.index(n) if n in order else len(order))
            parts = ", ".join(f"{n} {fmt(agreement[n], '.2e')}" if agreement[n] is not None
                              else f"{n} not finite" for n in names)
            verdict = ""
            if tolerance is not None:
                within = all(v is not None and v <= tolerance for v in agreement.values())
                verdict = f"; {'within' if within else 'OUTSIDE'} the tolerance {tolerance:g}"
            print(f"  tensor cores vs simt, largest difference of the largest value: {parts}"
                  f"{verdict}")
    summary["attention"] = out


def compare_planner(planner, summary):
    print("\nPlanner on the GPU: predicted vs measured peak (measured / predicted; must fit the budget, "
          f"and the prediction be within {PREDICTION_TOLERANCE:.0%} of the measured peak)")
    print(f"  {'budget':>8}{'micro x steps':>15}{'ckpt':>6}{'predicted MiB':>15}{'measured MiB':>14}{'ratio':>8}  result")
    ok = True
    for r in dicts(planner.get("runs")):
        if r.get("status") != "ok":
            print(f"  {str(r.get('budget')):>8}  {r.get('status')}: {r.get('message', '')}")
            ok = False
            continue
        pred, meas = finite(r.get("predicted_peak")), finite(r.get("measured_peak"))
        budget = finite(r.get("budget_bytes"))
        fits = meas is not None and budget is not None and meas <= budget
        predicted = pred is not None and meas is not None and abs(pred - meas) <= PREDICTION_TOLERANCE * meas
        ok = ok and fits and predicted
        fails = ([] if fits else ["over budget"]) + \
            ([] if predicted else [f"predicted not within {PREDICTION_TOLERANCE:.0%}"])
        plan = f"{r.get('micro_batch_size')} x {r.get('accumulation_steps')}"
        print(f"  {str(r.get('budget')):>8}{plan:>15}{str(r.get('gradient_checkpointing', '-')):>6}"
              f"{fmt(mib(pred), '.0f'):>15}{fmt(mib(meas), '.0f'):>14}{fmt(ratio(meas, pred), '.3f'):>8}"
              f"  {'FAIL (' + ', '.join(fails) + ')' if fails else 'pass'}")
        summary["planner"][str(r.get("budget"))] = dict(predicted_peak=pred, measured_peak=meas,
                                                        ratio=ratio(meas, pred), fits=fits,
                                                        predicted_within_tolerance=predicted)
    return ok


# Plots (--plots). Each one draws what its files hold and names, in a note under the panels, what
# it left out (a run that failed, a figure that is missing); nothing here changes the outcome.
OURS, SIMT, TORCH = "#1f77b4", "#8fbbe0", "#ff7f0e"  # ours blue, our other kernel light blue, PyTorch orange
PREDICTED, LIMIT = "#9467bd", "#d62728"  # the planner's prediction; targets and budgets
GREY_LINE = "#555555"  # the copy bandwidth, the yardstick of the kernels plot


def on_devices(ours, torch_):
    """ "on DEVICE" for a title, naming both devices when the two runs were not on the same one."""
    a = ours.get("device") if isinstance(ours, dict) else None
    b = torch_.get("device") if isinstance(torch_, dict) else None
    if a and b and a != b:
        return f"ours on {a}, PyTorch on {b}"
    return f"on {a or b or 'an unnamed device'}"


def runs_of(j):
    return dicts((j or {}).get("runs"))


def gib(x):
    x = finite(x)
    return None if x is None else x / 2**30


def copy_bandwidth(j):
    v = finite(j.get("copy_gb_per_s"))
    return "n/a" if v is None else f"{v:.1f} GB/s"


def simt_note(ours):
    """A note for a GPT-2 plot drawn from the rerun on the f32-math attention (gpt2_simt.json)."""
    return ["ours: the rerun on the f32-math attention kernel (MB_ATTENTION_KERNEL=simt)"] \
        if "simt" in str(ours.get("attention", "")) else []


def plot_training_loss(ours, torch_, path, kind=GPT, torch_file="torch_gpt2.json"):
    # PyTorch's line dashed over ours: the two runs' losses agree closely, and one would hide the other.
    sides = [("ours", OURS, ours, None), ("PyTorch", TORCH, torch_, "7,4")]
    panels = {}  # micro-batch -> {side: losses}, in the order the runs were made
    failed = {}  # micro-batch -> the sides whose run failed
    notes = simt_note(ours)
    for who, _, j, _ in sides:
        if not j:
            continue
        if j.get("error"):
            notes.append(f"{who}: failed before any run: {j['error']}")
        for r in runs_of(j):
            b = r.get("batch")
            panels.setdefault(b, {})
            if r.get("error"):
                failed.setdefault(b, []).append(who)
                notes.append(f"{who}, micro-batch {b}: failed, left out: {r['error']}")
            elif r.get("losses"):
                panels[b][who] = r["losses"]
            else:
                notes.append(f"{who}, micro-batch {b}: no losses recorded")
    if not torch_:
        notes.append(f"{torch_file}: not found (ours only)")
    warmup = finite(ours.get("warmup"))
    warmup = finite((torch_ or {}).get("warmup")) if warmup is None else warmup
    cols = max(1, min(3, len(panels)))
    pw, ph, left, gap = 360, 230, 75, 40
    width = left + cols * pw + (cols - 1) * (left + gap - 20) + 30
    title = (f"{kind.name} ({ours.get('model')}) training loss per optimizer step, ours vs PyTorch, "
             f"{on_devices(ours, torch_)}")
    subtitle = ("Both runs start from the same weights and see the same "
                + ("tokens" if kind is GPT else "images")
                + (f"; the grey band is the {warmup:g} warm-up steps (not timed)" if warmup else ""))
    fig = Figure(width, title, subtitle)
    fig.legend([(who, colour, "dash" if dash else "line") for who, colour, j, dash in sides if j])
    for i, (b, losses) in enumerate(panels.items()):
        x = left + (i % cols) * (pw + left + gap - 20)
        y = fig.top + 25 + (i // cols) * (ph + 85)
        series = [(who, colour, list(enumerate(losses[who])), dash) for who, colour, _, dash in sides
                  if who in losses]
        label = f"micro-batch {b}" + (f" ({' and '.join(failed[b])} failed)" if b in failed else "")
        line_panel(fig, (x, y, pw, ph), series, title=label, xlabel="optimizer step", ylabel="loss",
                   shade=(0, warmup - 0.5, "warm-up") if warmup else None, message="no losses")
    if not panels:
        line_panel(fig, (left, fig.top + 25, pw, ph), [], message="no runs")
    for n in notes:
        fig.note(n)
    fig.save(path)


def plot_training_step(ours, torch_, path, kind=GPT, torch_file="torch_gpt2.json"):
    theirs = {r.get("batch"): r for r in runs_of(torch_) if not r.get("error")}
    notes = simt_note(ours) + [f"{who}, micro-batch {r.get('batch')}: failed, left out: {r['error']}"
                               for who, j in (("ours", ours), ("PyTorch", torch_)) for r in runs_of(j)
                               if r.get("error")]
    if ours.get("error"):
        notes.insert(0, f"ours: failed before any run: {ours['error']}")
    if not torch_:
        notes.append(f"{torch_file}: not found (ours only)")
    mine = {r.get("batch"): r for r in runs_of(ours) if not r.get("error")}
    batches = list(mine) + [b for b in theirs if b not in mine]
    memory = ("peak allocated memory", "GiB", "peak_allocated_bytes", gib)
    memory_note = "the allocator's peak allocated memory (PyTorch: max_memory_allocated)"
    if torch_ and not any(finite(r.get("peak_allocated_bytes")) is not None for r in theirs.values()):
        if all(host_memory(mine[b], theirs[b]) for b in mine if b in theirs) and set(mine) & set(theirs):
            # On the CPU: both processes' resident memory, measured alike.
            memory = ("growth of resident memory", "MiB", "host_rss_growth_bytes", mib)
            memory_note = "the growth of each process's resident memory over the run"
        else:
            notes.append("PyTorch's peak memory is recorded on CUDA only (n/a)")
    categories = [f"B = {b}" for b in batches]
    w, h, left = max(240, 115 * len(batches)), 250, 80
    width = 2 * (left + w) + 40
    title = (f"{kind.name} ({ours.get('model')}) training step, ours vs PyTorch, by micro-batch, "
             f"{on_devices(ours, torch_)}")
    fig = Figure(width, title, f"Median time per optimizer step after the warm-up and {memory_note}; "
                               "lower is better")
    fig.legend([("ours", OURS, "box")] + ([("PyTorch", TORCH, "box")] if torch_ else []))
    y = fig.top + 25
    panels = [("median step time", "ms", "step_ms_median", finite), memory]
    for i, (panel, unit, key, scale) in enumerate(panels):
        series = [("ours", OURS, [scale((mine.get(b) or {}).get(key)) for b in batches])]
        if torch_:
            series.append(("PyTorch", TORCH, [scale((theirs.get(b) or {}).get(key)) for b in batches]))
        bar_panel(fig, (left + i * (left + w + 20), y, w, h), categories, series, title=f"{panel} ({unit})",
                  axis_label=unit)
    for n in notes:
        fig.note(n)
    fig.save(path)


def plot_kernels(ours, torch_, path):
    mine = {k.get("name"): k for k in dicts(ours.get("kernels"))}
    theirs = {k.get("name"): k for k in dicts((torch_ or {}).get("kernels"))}
    # copy is the yardstick (1 by definition): drawn as the dashed line, not as a bar.
    names = [n for n in list(mine) + [n for n in theirs if n not in mine] if n != "copy"]
    markers, notes_by_kernel = [], {}
    for i, n in enumerate(names):
        k = mine.get(n) or {}
        target = finite(k.get("target"))
        target = finite((theirs.get(n) or {}).get("target")) if target is None else target
        if target is not None:
            markers.append((i, target, LIMIT))
        words = [f"target {target:.2f}"] if target is not None else []
        if n in mine and not k.get("checked", False):  # as the table: a wrong result meets no target
            words.append("WRONG result")
        elif n in mine and target is not None:
            words.append("pass" if k.get("meets_target", True) else "FAIL")
        notes_by_kernel[i] = ", ".join(words)
    notes = [f"ours, {e.get('name')}: failed, left out: {e.get('error')}"
             for e in dicts(ours.get("errors"))]
    if not torch_:
        notes.append("torch_kernels.json: not found (ours only)")
    left = 30 + max([len(str(n)) * 12 * 0.56 for n in names] + [80])
    w = 560
    h = max(60, len(names) * (18 * (2 if torch_ else 1) + 16))
    copies = f"ours {copy_bandwidth(ours)}" + (f", PyTorch {copy_bandwidth(torch_)}" if torch_ else "")
    fig = Figure(int(left + w + 40), "Memory-bound kernels: fraction of the copy bandwidth, "
                                     f"{on_devices(ours, torch_)}",
                 f"Each side against its own copy ({copies}"
                 + (f"; {ours['sizes']} sizes" if ours.get("sizes") else "") + "); higher is better")
    fig.legend([("ours", OURS, "box")] + ([("PyTorch", TORCH, "box")] if torch_ else [])
               + ([("target", LIMIT, "tick")] if markers else []))
    series = [("ours", OURS, [(mine.get(n) or {}).get("ratio_to_copy") for n in names])]
    if torch_:
        series.append(("PyTorch", TORCH, [(theirs.get(n) or {}).get("ratio_to_copy") for n in names]))
    bar_panel(fig, (left, fig.top + 22, w, h), [str(n) for n in names], series, horizontal=True,
              markers=markers, lines=[(1.0, GREY_LINE, "copy")], category_notes=notes_by_kernel,
              axis_label="fraction of the copy bandwidth", fmt_value=lambda v: f"{v:.3f}")
    for n in notes:
        fig.note(n)
    fig.save(path)


def plot_attention(ours, torch_, path):
    shape = ours.get("shape")
    notes = []
    sides = [("ours, tensor cores" if ours.get("kernel") == "tensor" else "ours", OURS, ours)]
    if "simt" in ours:  # a file from before there were two kernels has no "simt"
        sides.append(("ours, f32 math (simt)", SIMT, ours.get("simt")))
    if torch_ and torch_.get("shape") != shape:
        notes.append(f"PyTorch SDPA ran {tuple(torch_.get('shape') or ())}, not this shape: left out")
    elif torch_:
        sides.append(("PyTorch SDPA", TORCH, torch_))
    else:
        notes.append("torch_attention.json: not found (ours only)")
    drawn = []
    for label, colour, j in sides:
        if not isinstance(j, dict):
            notes.append(f"{label}: no figures, left out")
        elif j.get("error"):
            notes.append(f"{label}: failed, left out: {j['error']}")
        else:
            drawn.append((label, colour, [j.get("forward_ms"), j.get("forward_backward_ms")]))
    w, h, left = 560, 260, 80
    fig = Figure(left + w + 40, f"Causal attention {tuple(shape or ())} bf16: time per call, "
                                f"{on_devices(ours, None)}",
                 "Median of 20 calls after 3 warm-up calls; lower is better")
    fig.legend([(label, colour, "box") for label, colour, _ in drawn])
    bar_panel(fig, (left, fig.top + 22, w, h), ["forward", "forward + backward"], drawn, axis_label="ms")
    for n in notes:
        fig.note(n)
    fig.save(path)


def plot_planner(planner, device_name, path):
    runs = runs_of(planner)
    budgets, notes, status = [], [], {}
    for i, r in enumerate(runs):
        budgets.append(str(r.get("budget")))
        meas, budget = finite(r.get("measured_peak")), finite(r.get("budget_bytes"))
        words = [] if r.get("status") == "ok" else [str(r.get("status"))]
        if meas is not None and budget is not None and meas > budget:
            words.append("over budget")
        status[i] = ", ".join(words)
        if r.get("status") != "ok":
            logged = any(finite(r.get(key)) is not None for key in ("predicted_peak", "measured_peak"))
            notes.append(f"{r.get('budget')}: {r.get('status')}: {r.get('message', '')}"
                         + (" (what it logged is drawn)" if logged else ""))
    plan_device = next((r.get("device") for r in runs if r.get("device")), None)
    where = " ".join(x for x in (device_name, f"({plan_device})" if plan_device else None) if x)
    w, h, left = max(300, 130 * len(runs)), 260, 80
    fig = Figure(left + w + 40, f"Memory planner ({planner.get('model')}, {planner.get('precision')}): "
                                f"predicted vs measured peak per budget, on {where or 'an unnamed device'}",
                 "Measured: the allocator's reserved bytes above the Trainer's baseline, the largest over the "
                 "steps; it must stay under the budget")
    fig.legend([("predicted", PREDICTED, "box"), ("measured", OURS, "box"), ("budget", LIMIT, "tick")])
    series = [("predicted", PREDICTED, [gib(r.get("predicted_peak")) for r in runs]),
              ("measured", OURS, [gib(r.get("measured_peak")) for r in runs])]
    markers = [(i, gib(r.get("budget_bytes")), LIMIT) for i, r in enumerate(runs)]
    bar_panel(fig, (left, fig.top + 22, w, h), budgets, series, markers=markers, category_notes=status,
              axis_label="GiB")
    for n in notes:
        fig.note(n)
    fig.save(path)


def write_plots(directory, files):
    print(f"\nPlots in {directory}:")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        print(f"  none drawn: {e}")
        return
    # The GPU's name, for the planner, whose file has only the Trainer's device ("cuda:0").
    device_name = next((j.get("device") for n, j in files.items()
                        if isinstance(j, dict) and j.get("device") and not n.startswith("torch_")), None)
    plots = [("gpt2_loss.svg", "gpt2.json",
              lambda j, path: plot_training_loss(j, files.get("torch_gpt2.json"), path)),
             ("gpt2_step.svg", "gpt2.json",
              lambda j, path: plot_training_step(j, files.get("torch_gpt2.json"), path)),
             ("kernels.svg", "kernels.json",
              lambda j, path: plot_kernels(j, files.get("torch_kernels.json"), path)),
             ("attention.svg", "attention.json",
              lambda j, path: plot_attention(j, files.get("torch_attention.json"), path)),
             ("planner.svg", "planner.json", lambda j, path: plot_planner(j, device_name, path))]
    for model in (m for m in IMAGE_MODELS if f"image_{m}.json" in files):  # only where they ran
        theirs = files.get(f"torch_image_{model}.json")
        plots += [(f"image_{model}_loss.svg", f"image_{model}.json",
                   lambda j, path, t=theirs, m=model: plot_training_loss(j, t, path, IMAGE, f"torch_image_{m}.json")),
                  (f"image_{model}_step.svg", f"image_{model}.json",
                   lambda j, path, t=theirs, m=model: plot_training_step(j, t, path, IMAGE, f"torch_image_{m}.json"))]
    for name, source, draw in plots:
        if not isinstance(files.get(source), dict):
            print(f"  {name}: skipped ({source} not found)")
            continue
        path = os.path.join(directory, name)
        try:
            draw(files[source], path)
            print(f"  wrote {path}")
        except Exception as e:  # a plot that cannot be drawn must not hide the tables' verdict
            print(f"  {name}: not drawn: {type(e).__name__}: {e}")


def measured(j):
    """Whether a GPT-2 file has a run that measured something."""
    return any(not r.get("error") for r in dicts((j or {}).get("runs")))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir")
    p.add_argument("--json", default="")
    p.add_argument("--plots", default="", metavar="PLOTDIR")
    a = p.parse_args()
    summary = {"kernels": {}, "gpt2": {}, "gpt2_simt": {}, "planner": {}, "attention": {},
               **{f"image_{m}": {} for m in IMAGE_MODELS}, "not_checked": [], "unreadable": []}
    unreadable = summary["unreadable"]
    ok = True
    files = {}  # what was read, for the plots
    ours = files["kernels.json"] = load(a.dir, "kernels.json", unreadable)
    if ours:
        torch_ = files["torch_kernels.json"] = load(a.dir, "torch_kernels.json", unreadable)
        ok = compare_kernels(ours, torch_, summary) and ok
    ours = files["gpt2.json"] = load(a.dir, "gpt2.json", unreadable)
    # The check's rerun on the f32-math attention, where the tensor-core run measured nothing.
    simt = files["gpt2_simt.json"] = load(a.dir, "gpt2_simt.json", unreadable, missing_note=False)
    if ours or simt:
        torch_ = files["torch_gpt2.json"] = load(a.dir, "torch_gpt2.json", unreadable)
    if ours:
        ok = compare_training(ours, torch_, summary) and ok
    elif simt and "gpt2.json" not in unreadable:
        print("  (gpt2.json: the tensor-core run left no result, counted as failed)")
        ok = False
    if simt:
        ok = compare_training(simt, torch_, summary, "gpt2_simt",
                          ", on the f32-math attention kernel (gpt2_simt.json, MB_ATTENTION_KERNEL=simt)") and ok
    for model in IMAGE_MODELS:  # the CPU comparison's Fashion-MNIST models, where it wrote them
        ours = load(a.dir, f"image_{model}.json", unreadable, missing_note=False)
        if ours:
            files[f"image_{model}.json"] = ours
            torch_ = files[f"torch_image_{model}.json"] = load(a.dir, f"torch_image_{model}.json", unreadable)
            ok = compare_training(ours, torch_, summary, f"image_{model}", kind=IMAGE) and ok
    planner = files["planner.json"] = load(a.dir, "planner.json", unreadable)
    if planner:
        ok = compare_planner(planner, summary) and ok
    # No target: neither `ok` nor `found` (an attention run alone has nothing to pass).
    ours = files["attention.json"] = load(a.dir, "attention.json", unreadable)
    if ours:
        files["torch_attention.json"] = load(a.dir, "torch_attention.json", unreadable)
        compare_attention(ours, files["torch_attention.json"], summary)
    found = any(files.get(n) for n in ("kernels.json", "gpt2.json", "gpt2_simt.json", "planner.json",
                                       *(f"image_{m}.json" for m in IMAGE_MODELS))) or \
        bool(unreadable)
    if a.plots:
        # The plots follow the GPT-2 file that measured something.
        if not measured(files["gpt2.json"]) and measured(simt):
            files["gpt2.json"] = simt
        write_plots(a.plots, files)
    summary["pass"] = ok and found and not unreadable
    if unreadable:
        print(f"\nunreadable, counted as failed: {', '.join(unreadable)}")
    if summary["not_checked"]:
        print(f"\nnot checked, for want of a PyTorch figure: {'; '.join(summary['not_checked'])}")
    print("\n" + ("all targets and checks pass" if summary["pass"] else
                  "no results to compare" if not found else "some targets or checks FAIL"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(standard(summary), f, indent=2, allow_nan=False)
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
