"""The acceptance ratios of issue 13 from one `kvkeep bench all` results.json and, optionally, a
`kvkeep bench store --json` file: python3 scripts/acceptance_ratios.py RESULTS.json [STORE.json]."""
import json, sys
d = json.load(open(sys.argv[1]))["scenarios"]
m = lambda sc: d[sc]["modes"]
rows = []
def row(name, k, v, target, ok):
    rows.append(f"| {name} | {k:.4g} / {v:.4g} | {k / v if v else float('nan'):.3f} | {target} | {'yes' if ok else 'NO'} |")
s = m("session"); k, v = s["kvkeep"]["session_s"], s["vllm"]["session_s"]; row("S1 session_s kvkeep/vllm", k, v, "<= 1.05", k <= 1.05 * v)
t = m("ttft"); k, v = t["kvkeep"]["sizes"]["8192"]["cold_s"], t["vllm"]["sizes"]["8192"]["cold_s"]; row("S2 cold_s 8192 kvkeep/vllm", k, v, "<= 1.05", k <= 1.05 * v)
h = m("hol"); k, v = h["kvkeep"]["ttft_beside_prefill_s"], h["vllm"]["ttft_beside_prefill_s"]; row("S6 ttft_beside_prefill_s", k, v, "<= 1.2", k <= 1.2 * v)
k, v = h["kvkeep"]["long_prefill_ttft_s"], h["vllm"]["long_prefill_ttft_s"]; row("S6 long_prefill_ttft_s", k, v, "<= 1.05", k <= 1.05 * v)
r = m("restart"); k, v = r["kvkeep"]["after_engine_restart_ttft_s"], r["kvkeep"]["warm_ttft_s"]; row("S4 after_restart / warm (kvkeep)", k, v, "<= 1.2", k <= 1.2 * v)
if r["kvkeep"].get("after_engine_restart_device_ttft_s"):
    k, v = r["kvkeep"]["after_engine_restart_ttft_s"], r["kvkeep"]["after_engine_restart_device_ttft_s"]; row("S4 after_restart / device hits just after (same engine; not the issue's ratio)", k, v, "(<= 1.2)", k <= 1.2 * v)
k, v = r["kvkeep"]["restart_ready_s"], r["vllm"]["restart_ready_s"]; rows.append(f"| S4 restart_ready_s kvkeep - vllm | {k:.2f} / {v:.2f} | {k - v:+.2f} s | <= +1 s | {'yes' if k <= v + 1 else 'NO'} |")
a = m("agents"); k, v = a["kvkeep"]["turns_per_min"], a["none"]["turns_per_min"]; row("S5 turns_per_min kvkeep/none", k, v, ">= 5", k >= 5 * v)
if len(sys.argv) > 2:
    st = json.load(open(sys.argv[2]))["results"]
    row("store ram_get_verified/memcpy", st["ram_get_verified_gbps"], st["memcpy_gbps"], ">= 0.5", st["ram_get_verified_gbps"] >= 0.5 * st["memcpy_gbps"])
    row("store disk_get/direct_read", st["disk_get_gbps"], st["disk_direct_read_gbps"], ">= 0.5", st["disk_get_gbps"] >= 0.5 * st["disk_direct_read_gbps"])
print("| measure | kvkeep / reference | ratio | target | met |\n|---|---|---|---|---|")
print("\n".join(rows))
