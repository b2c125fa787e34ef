#!/usr/bin/env python3
"""Sets microbatch's benchmark results beside PyTorch's and checks them against the issue's targets.

Reads, from DIR (the files scripts/gpu_check.sh writes; a missing one is reported and skipped):
  kernels.json        bench_kernels_cuda        torch_kernels.json   benchmarks/torch_kernels.py
  gpt2.json           bench_gpt2_cuda           torch_gpt2.json      benchmarks/torch_gpt2.py
  planner.json        benchmarks/planner_cuda.sh
  attention.json      bench_attention_cuda      torch_attention.json benchmarks/torch_attention.py

Targets (memory-bound kernels, as a fraction of the device's copy bandwidth, Note [Bytes moved] in
benchmarks/kernels_cuda.cpp): accumulate >= 0.90, AdamW >= 0.85, gradient norm >= 0.80, softmax +
cross-entropy forward and backward >= 0.80; and each kernel must agree with the CPU reference.
GPT-2: both runs start from the same weights and tokens, so their first losses must agree within
0.02 (bf16 rounding), and a run that failed fails; speed and memory are reported as ratios,
without a target. Planner: the measured peak must stay within the budget. Attention (ours /
PyTorch SDPA time, and how far our two kernels are apart) has no target: it changes no outcome.

  python3 benchmarks/compare.py DIR [--json PATH]      exit status 1 when a target or a check fails
"""
import argparse
import json
import os
import sys


def load(directory, name):
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        print(f"  ({name}: not found, skipped)")
        return None
    with open(path) as f:
        return json.load(f)


def ratio(a, b):
    return a / b if a and b else None


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def mib(x):
    return None if x is None else x / 2**20


def compare_kernels(ours, torch_, summary):
    print("\nMemory-bound kernels: GB/s and the fraction of the copy bandwidth (higher is better); "
          "time ratio ours/PyTorch (lower is better)")
    theirs = {k["name"]: k for k in (torch_ or {}).get("kernels", [])}
    copy_ours = ours.get("copy_gb_per_s")
    copy_theirs = (torch_ or {}).get("copy_gb_per_s")
    print(f"  copy bandwidth: ours {fmt(copy_ours, '.1f')} GB/s, PyTorch {fmt(copy_theirs, '.1f')} GB/s "
          f"on {ours.get('device')} ({ours.get('sizes')} sizes)")
    print(f"  {'kernel':<30}{'ours ms':>10}{'GB/s':>9}{'vs copy':>9}{'target':>8}  {'result':<8}"
          f"{'torch ms':>10}{'vs copy':>9}{'ours/torch':>11}")
    ok = True
    for k in ours["kernels"]:
        t = theirs.get(k["name"], {})
        target = k.get("target")
        meets = k.get("meets_target", True)
        if not k.get("checked", False):
            result = "WRONG"
        elif target is None:
            result = "-"
        else:
            result = "pass" if meets else "FAIL"
        ok = ok and k.get("checked", False) and meets
        time_ratio = ratio(k.get("median_ms"), t.get("median_ms"))
        print(f"  {k['name']:<30}{k['median_ms']:>10.4f}{k['gb_per_s']:>9.1f}{fmt(k.get('ratio_to_copy'), '.3f'):>9}"
              f"{fmt(target, '.2f'):>8}  {result:<8}{fmt(t.get('median_ms'), '.4f'):>10}"
              f"{fmt(t.get('ratio_to_copy'), '.3f'):>9}{fmt(time_ratio, '.3f'):>11}")
        summary["kernels"][k["name"]] = dict(ours_ms=k["median_ms"], ours_ratio_to_copy=k["ratio_to_copy"],
                                             target=target, result=result, torch_ms=t.get("median_ms"),
                                             time_ratio_ours_over_torch=time_ratio)
    # A kernel whose run threw has no row above; its target counts as missed.
    for e in ours.get("errors", []):
        print(f"  {e['name']:<30}  failed: {e['error']}")
        summary["kernels"][e["name"]] = dict(result="failed", error=e["error"])
        ok = False
    return ok


def compare_gpt2(ours, torch_, summary):
    print(f"\nGPT-2 training step ({ours.get('model')}, {ours.get('parameters')} parameters): ours / PyTorch — "
          "step time and memory lower is better, tokens/s higher is better")
    theirs = {r["batch"]: r for r in (torch_ or {}).get("runs", [])}
    print(f"  {'batch':>5}{'ours ms':>10}{'torch ms':>10}{'ours tok/s':>12}{'torch tok/s':>12}{'tok/s ratio':>12}"
          f"{'ours MiB':>10}{'torch MiB':>11}{'mem ratio':>10}{'loss[0] ours':>14}{'torch':>9}{'max |dloss|':>12}  result")
    ok = True
    if ours.get("error"):
        print(f"  failed before any run: {ours['error']}")
        summary["gpt2"]["error"] = ours["error"]
        ok = False
    for r in ours.get("runs", []):
        if r.get("error"):
            print(f"  {r['batch']:>5}  failed: {r['error']}")
            summary["gpt2"][str(r["batch"])] = dict(result="failed", error=r["error"])
            ok = False
            continue
        t = theirs.get(r["batch"], {})
        loss_ok = None
        max_diff = None
        if t.get("losses"):
            max_diff = max(abs(x - y) for x, y in zip(r["losses"], t["losses"]))
            loss_ok = abs(r["losses"][0] - t["losses"][0]) <= 0.02
            ok = ok and loss_ok
        result = "-" if loss_ok is None else ("pass" if loss_ok else "FAIL (first losses differ)")
        tok_ratio = ratio(r["tokens_per_s"], t.get("tokens_per_s"))
        mem_ratio = ratio(r.get("peak_allocated_bytes"), t.get("peak_allocated_bytes"))
        print(f"  {r['batch']:>5}{r['step_ms_median']:>10.1f}{fmt(t.get('step_ms_median'), '.1f'):>10}"
              f"{r['tokens_per_s']:>12.0f}{fmt(t.get('tokens_per_s'), '.0f'):>12}{fmt(tok_ratio, '.3f'):>12}"
              f"{fmt(mib(r.get('peak_allocated_bytes')), '.0f'):>10}{fmt(mib(t.get('peak_allocated_bytes')), '.0f'):>11}"
              f"{fmt(mem_ratio, '.3f'):>10}{r['losses'][0]:>14.4f}{fmt((t.get('losses') or [None])[0], '.4f'):>9}"
              f"{fmt(max_diff, '.4f'):>12}  {result}")
        summary["gpt2"][str(r["batch"])] = dict(
            ours_step_ms=r["step_ms_median"], torch_step_ms=t.get("step_ms_median"), ours_tokens_per_s=r["tokens_per_s"],
            torch_tokens_per_s=t.get("tokens_per_s"), tokens_per_s_ratio=tok_ratio,
            ours_peak_allocated=r.get("peak_allocated_bytes"), torch_peak_allocated=t.get("peak_allocated_bytes"),
            memory_ratio=mem_ratio, first_loss_ours=r["losses"][0], first_loss_torch=(t.get("losses") or [None])[0],
            max_loss_difference=max_diff, result=result)
    return ok


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
    print("\nPlanner on the GPU: predicted vs measured peak (measured / predicted; must fit the budget)")
    print(f"  {'budget':>8}{'micro x steps':>15}{'ckpt':>6}{'predicted MiB':>15}{'measured MiB':>14}{'ratio':>8}  result")
    ok = True
    for r in planner.get("runs", []):
        if r.get("status") != "ok":
            print(f"  {r.get('budget'):>8}  {r.get('status')}: {r.get('message', '')}")
            ok = False
            continue
        pred, meas, budget = r.get("predicted_peak"), r.get("measured_peak"), r.get("budget_bytes")
        fits = meas is not None and budget is not None and meas <= budget
        ok = ok and fits
        plan = f"{r.get('micro_batch_size')} x {r.get('accumulation_steps')}"
        print(f"  {r['budget']:>8}{plan:>15}{str(r.get('gradient_checkpointing', '-')):>6}"
              f"{fmt(mib(pred), '.0f'):>15}{fmt(mib(meas), '.0f'):>14}{fmt(ratio(meas, pred), '.3f'):>8}"
              f"  {'pass' if fits else 'FAIL (over budget)'}")
        summary["planner"][r["budget"]] = dict(predicted_peak=pred, measured_peak=meas,
                                               ratio=ratio(meas, pred), fits=fits)
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir")
    p.add_argument("--json", default="")
    a = p.parse_args()
    summary = {"kernels": {}, "gpt2": {}, "planner": {}, "attention": {}}
    ok = True
    found = False
    ours = load(a.dir, "kernels.json")
    if ours:
        found = True
        ok = compare_kernels(ours, load(a.dir, "torch_kernels.json"), summary) and ok
    ours = load(a.dir, "gpt2.json")
    if ours:
        found = True
        ok = compare_gpt2(ours, load(a.dir, "torch_gpt2.json"), summary) and ok
    planner = load(a.dir, "planner.json")
    if planner:
        found = True
        ok = compare_planner(planner, summary) and ok
    # No target: neither `ok` nor `found` (an attention run alone has nothing to pass).
    ours = load(a.dir, "attention.json")
    if ours:
        compare_attention(ours, load(a.dir, "torch_attention.json"), summary)
    summary["pass"] = ok and found
    print("\n" + ("all targets and checks pass" if summary["pass"] else
                  "no results to compare" if not found else "some targets or checks FAIL"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
