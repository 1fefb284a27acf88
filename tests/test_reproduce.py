"""scripts/reproduce.py's generated blocks: the bars table is computed from the results it names."""

import importlib.util
import hashlib
import json

import numpy as np
import pytest

from ushash.config import ROOT


def _reproduce():
    spec = importlib.util.spec_from_file_location("reproduce", ROOT / "scripts" / "reproduce.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(values: dict) -> dict:
    """{method: {bits: (paired, label)}} -> a sweep results.json "summary"."""
    return {m: {str(b): {p: {"tie_map@10": {"mean": [v, 0.01, 3]}} for p, v in zip(("paired", "label"), pl)}
                for b, pl in by_bits.items()} for m, by_bits in values.items()}


def test_bars_table_says_met_or_missed_by_how_much(tmp_path, monkeypatch):
    r = _reproduce()
    monkeypatch.setattr(r, "ROOT", tmp_path)
    monkeypatch.setattr(r, "ABLATION_SETS", {"a": ("sweep_a64", "a-64b")})
    monkeypatch.setattr(r, "BITS_SETS", {"a": ("sweep_a", "a-bits")})
    exp = tmp_path / "experiments"
    for folder, summ in (("a-64b", {"ushash": {64: (0.30, 0.50)}, "itq": {64: (0.25, 0.52)}, "float": {64: (0.32, 0.6)}}),
                         ("a-bits", {"ushash": {16: (0.2, 0.4), 32: (0.2, 0.4), 128: (0.3, 0.5)},
                                     "itq": {16: (0.2003, 0.3), 32: (0.1, 0.3), 128: (0.3, 0.5)}})):
        (exp / folder).mkdir(parents=True)
        (exp / folder / "results.json").write_text(json.dumps({"summary": _summary(summ)}))
    key = exp / "cachesim" / "cachekey-a64"
    key.mkdir(parents=True)
    key.joinpath("results.json").write_text(json.dumps({"rows": [
        {"method": "LSH 64-bit codes of z only", "false_hit_rate": 0.001, "hit_rate": 0.9},
        {"method": "US-HASH 64-bit codes only", "false_hit_rate": 0.0035, "hit_rate": 0.95}]}))
    rows = {line.split(" | ")[1]: line for line in r.bars_body().splitlines() if line.startswith("| a |")}
    # s.e. of a difference of two 3-seed means whose stds are 0.01: sqrt(2 * 0.01^2 / 3) = 0.008
    assert rows["64 bits, paired >= ITQ + 0.03"].endswith("(+0.050, s.e. 0.008) | met |")
    assert rows["64 bits, paired >= 0.9 x float space"].endswith("0.300 of 0.320 (0.94x, s.e. 0.03x) | met |")
    assert rows["64 bits, label >= ITQ"].endswith("(-0.020, s.e. 0.008) | **missed by 0.020** |")
    assert rows["16 bits, paired >= ITQ"].endswith("(-0.0003, s.e. 0.008) | **missed by 0.0003** |")  # not shown as 0.000
    assert rows["128 bits, label >= ITQ"].endswith("(+0.000, s.e. 0.008) | met |")  # a tie meets a >= bar
    assert "**missed by 0.0025**" in rows["cache key, radius 2, codes only: false hits / request <= LSH codes of z"]
    # a ratio just under its bar is not rounded onto it: 0.269 / 0.3 = 0.8967 reads 0.897x, missed by 0.003x
    (exp / "a-64b" / "results.json").write_text(json.dumps({"summary": _summary(
        {"ushash": {64: (0.269, 0.5)}, "itq": {64: (0.25, 0.5)}, "float": {64: (0.3, 0.6)}})}))
    rows = {line.split(" | ")[1]: line for line in r.bars_body().splitlines() if line.startswith("| a |")}
    assert rows["64 bits, paired >= 0.9 x float space"].endswith("(0.897x, s.e. 0.03x) | **missed by 0.003x** |")
    # a held-out set: its 64-bit rows, marked, and nothing else of it (no other lengths, no cache key)
    monkeypatch.setattr(r, "HELDOUT_SETS", {"h": ("sweep_h64", "h-64b")})
    (exp / "h-64b").mkdir()
    (exp / "h-64b" / "results.json").write_text(json.dumps({"summary": _summary(
        {"ushash": {64: (0.40, 0.35)}, "itq": {64: (0.37, 0.32)}, "float": {64: (0.44, 0.4)}})}))
    held = [line for line in r.bars_body().splitlines() if line.startswith("| h (held out) |")]
    assert [line.split(" | ")[1] for line in held] == [
        "64 bits, paired >= ITQ + 0.03", "64 bits, paired >= 0.9 x float space", "64 bits, label >= ITQ"]
    assert held[0].endswith("(+0.030, s.e. 0.008) | met |") and held[1].endswith("(0.91x, s.e. 0.02x) | met |")
    # a set without results is left out, and nothing at all gives no block
    monkeypatch.setattr(r, "HELDOUT_SETS", {})
    monkeypatch.setattr(r, "ABLATION_SETS", {"b": ("sweep_b64", "b-64b")})
    monkeypatch.setattr(r, "BITS_SETS", {"b": ("sweep_b", "b-bits")})
    assert r.bars_body() is None


def test_a_printed_number_is_never_rounded_to_the_other_side_of_its_verdict():
    """0.89996 printed "0.900x" beside "missed by 0.000x"; 0.487 vs 0.487 beside "missed"; "missed by 0.0000"."""
    r = _reproduce()
    assert r.times(0.89996) == "0.89996x" and r.short_of(0.89996) == "**missed by 0.00004x**"
    assert r.times(0.897) == "0.897x" and r.times(0.95) == "0.95x" and r.short_of(0.77) == "**missed by 0.13x**"
    assert r.versus(0.48701, 0.48705) == "0.48701 vs 0.48705" and r.versus(0.4871, 0.4869) == "0.487 vs 0.487"
    assert r.amount(0.00003, 4) == "0.00003" and r.amount(0.0152, 4) == "0.0152" and r.amount(0.0, 3) == "0.000"
    for x in np.random.default_rng(0).uniform(0.85, 0.95, 2000):   # the printed ratio is on the verdict's side
        printed = float(r.times(x)[:-1])
        assert (printed >= 0.9) == (x >= 0.9) and (x >= 0.9 or float(r.short_of(x)[12:-3]) > 0)


def test_the_64_bit_bars_on_another_machine_beside_the_published_ones(tmp_path, monkeypatch):
    """rerun64's block: a row per run (the published experiment and its rerun), each with its stamp's machine
    and its own verdicts, computed from the two results files."""
    from ushash.evaluation.sweep import variant_dir

    r = _reproduce()
    monkeypatch.setattr(r, "ROOT", tmp_path)
    monkeypatch.setattr(r, "ABLATION_SETS", {"a": ("sweep_a64", "a-64b")})
    exp = tmp_path / "experiments"
    again = variant_dir(exp / "a-64b", r.RERUN64)
    for folder, summ in ((exp / "a-64b", {"ushash": {64: (0.30, 0.50)}, "itq": {64: (0.25, 0.52)}, "float": {64: (0.32, 0.6)}}),
                         (again, {"ushash": {64: (0.27, 0.53)}, "itq": {64: (0.25, 0.52)}, "float": {64: (0.32, 0.6)}})):
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps({"summary": _summary(summ), "runs": [
            {"key": "ushash-64b-s0", "digest": "amd" if folder == again else "intel"}]}))
    stamps = exp / "reproduce"
    stamps.mkdir()
    for step, cpu in (("sweep_a64", "Intel(R) Xeon(R) Processor"), ("rerun64_a", "AMD EPYC")):
        (stamps / f"{step}.json").write_text(json.dumps({"command": f"python -m {step}", "date": "2026-12-06",
                                                         "machine": f"2 x86_64 cores ({cpu}), no GPU", "wall_s": 60}))
    rows = [line for line in r.rerun64_body().splitlines() if line.startswith("| a |")]
    assert rows == [
        "| a | published: Intel(R) Xeon(R) Processor, 2026-12-06 | 0.300 | 0.250 | +0.050 (met) | 0.320 | 0.94x (met) "
        "| 0.500 vs 0.520 (missed) |",
        "| a | rerun: AMD EPYC, 2026-12-06 | 0.270 | 0.250 | +0.020 (missed) | 0.320 | 0.84x (missed) "
        "| 0.530 vs 0.520 (met) |"]
    # the rerun's runs are the published ones (the same CPU model: the sweep read them back): not shown as a rerun
    (again / "results.json").write_text((exp / "a-64b" / "results.json").read_text())
    body = r.rerun64_body()
    assert "| a |" not in body and "No rerun on another machine is recorded" in body and "a (2026-12-06)" in body
    (stamps / "rerun64_a.json").unlink()   # no rerun: no block
    assert r.rerun64_body() is None


def test_the_start_val_block_names_the_run_of_the_64_bit_rows_it_quotes(tmp_path, monkeypatch):
    """start-val's rows quote the 64-bit experiment's ITQ, float space and defaults; its first line named only the
    start_val step's date and machine, so a 64-bit experiment run elsewhere went out under another machine."""
    from ushash.evaluation.sweep import run_path, variant_dir

    r = _reproduce()
    monkeypatch.setattr(r, "ROOT", tmp_path)
    monkeypatch.setattr(r, "ABLATION_SETS", {"a": ("sweep_a64", "a-64b")})
    exp = tmp_path / "experiments"
    folder = variant_dir(exp / "a-64b", r.START_VAL)
    folder.mkdir(parents=True)
    runs = [{"key": f"ushash-64b-s{s}", "digest": f"d{s}" * 8, "seed": s} for s in range(3)]
    (folder / "results.json").write_text(json.dumps({"runs": runs, "runs_wall_s": 120,
                                                     "summary": _summary({"ushash": {64: (0.3, 0.5)}})}))
    (exp / "a-64b" / "results.json").write_text(json.dumps({"summary": _summary(
        {"ushash": {64: (0.28, 0.49)}, "itq": {64: (0.25, 0.47)}, "float": {64: (0.31, 0.5)}})}))
    for run in runs:
        f = run_path(exp / "a-64b", run["key"], run["digest"]) / "result.json"
        f.parent.mkdir(parents=True)
        f.write_text(json.dumps({"starts": {"itq": 0.4, "lsh": 0.35}, "start": "itq", "rows": [
            {"method": "ushash", "protocol": p, "tie_map@10": v} for p, v in (("paired", 0.3), ("label", 0.5))]}))
    stamps = exp / "reproduce"
    stamps.mkdir()
    for step, cpu, date in (("start_val_a", "AMD EPYC", "2026-12-07"), ("sweep_a64", "Intel(R) Xeon(R) Processor",
                                                                       "2026-12-01")):
        (stamps / f"{step}.json").write_text(json.dumps({"command": f"python -m {step}", "date": date,
                                                         "machine": f"2 x86_64 cores ({cpu}), no GPU"}))
    first = r.start_val_body().split("\n", 1)[0]
    assert "2026-12-07" in first and "AMD EPYC" in first
    assert "the 64-bit experiment beside it: 2026-12-01" in first and "Intel(R) Xeon(R) Processor" in first


def test_cache_bars_table_is_computed_from_the_runs(tmp_path, monkeypatch):
    r = _reproduce()
    monkeypatch.setattr(r, "ROOT", tmp_path)
    exp = tmp_path / "experiments"
    test = {"false_hits": 0, "hits": 1000, "false_per_hit_upper": 0.003, "headroom_captured": 0.55, "hit_rate": 0.97,
            "exact_hit_rate": 0.9, "oracle_hit_rate": 0.99, "false_per_hit": 0.0}
    looser = {**test, "headroom_captured": 0.9, "hit_rate": 0.99}   # another budget's row: not a bar
    for d, obj in (("budget", {"results": [{"dataset": "a", "budgets": {"0.01": {"test": test}, "0.05": {"test": looser}}}]}),
                   ("gptcache", {"results": [{"dataset": "a", "ushash": {"0.01": test, "0.05": looser}, "embeddings": {"z": {"sweep": [
                       {"cosine": 0.9, "test_hit_rate": 0.99, "test_false_per_hit": 0.02},    # more hits, but false ones
                       {"cosine": 0.99, "test_hit_rate": 0.975, "test_false_per_hit": 0.0},   # the one to beat
                       {"cosine": 1.0, "test_hit_rate": 0.6, "test_false_per_hit": 0.0}]}}}]})):
        (exp / d).mkdir(parents=True)
        (exp / d / "results.json").write_text(json.dumps(obj))
    rows = {line.split(" | ")[0][2:]: line for line in r.cache_bars_body().splitlines() if line.startswith("| ")}
    assert "test false hits per hit <= 5% (95 % upper bound)" not in rows   # the bars are at the 1 % budget only
    assert "met: 0 of 1,000 hits (upper 0.300%)" in rows["test false hits per hit <= 1% (95 % upper bound)"]
    assert "**missed** by 5.0 points: 55.0%" in rows["headroom captured >= 60 %"]
    assert ("**missed** by 0.0050: GPTCache 0.9750 (cos >= 0.990, chosen on test) against ushash 0.9700"
            in rows["hit rate >= real GPTCache's at the same false-hit rate, export z"])


def test_every_block_publish_writes_is_marked_once_in_its_file():
    """publish leaves a file as it is when a block's markers are missing (it says so and goes on), so a
    renamed or deleted marker would silently freeze that table: every block it writes is marked exactly once."""
    r = _reproduce()
    for doc, name in r.blocks():
        text = (ROOT / doc).read_text(encoding="utf-8")
        assert text.count(f"<!-- reproduce:{name} -->") == 1 and text.count(f"<!-- /reproduce:{name} -->") == 1, (doc, name)


def test_every_step_runs_a_module_or_script_that_exists():
    r = _reproduce()
    for step, line in r.STEPS.items():
        words = line.split()
        assert words[0] == "python", step
        if words[1] == "-m":
            assert (ROOT / (words[2].replace(".", "/") + ".py")).exists(), (step, words[2])
        else:
            assert (ROOT / words[1]).exists(), (step, words[1])
    assert set(r.NEEDS) <= set(r.STEPS) and {n for ns in r.NEEDS.values() for n in ns} <= set(r.STEPS)


def test_a_block_states_the_machine_its_runs_recorded_not_the_publishing_one(tmp_path, monkeypatch):
    r = _reproduce()
    monkeypatch.setattr(r, "ROOT", tmp_path)
    monkeypatch.setattr(r, "machine", lambda: "the publishing machine")
    stamps = tmp_path / "experiments" / "reproduce"
    stamps.mkdir(parents=True)
    for step, machine in (("s0", "2 x86_64 cores, no GPU"), ("s1", "2 x86_64 cores, no GPU"),
                          ("s2", "2 x86_64 cores (AMD EPYC), no GPU")):
        (stamps / f"{step}.json").write_text(json.dumps({"command": "x", "date": "2026-12-02", "machine": machine,
                                                         "versions": "torch 2.14.1", "wall_s": 1.0}))
    assert r.made_on(["s0", "s1", "missing"]) == "2 x86_64 cores, no GPU, torch 2.14.1"
    assert r.made_on(["s0", "s2"]) == ("2 x86_64 cores, no GPU, torch 2.14.1; "
                                       "2 x86_64 cores (AMD EPYC), no GPU, torch 2.14.1")
    assert r.made_on([]) == ""
    # the ablation block, published on "the publishing machine", states its runs' machine
    monkeypatch.setattr(r, "ABLATIONS", {"shipped defaults": ""})
    monkeypatch.setattr(r, "ABLATION_SETS", {"a": ("sweep_a64", "a-64b")})
    from ushash.evaluation.sweep import variant_dir
    folder = variant_dir(tmp_path / "experiments" / "a-64b", r.ablation_overrides("shipped defaults"))
    folder.mkdir(parents=True)
    folder.joinpath("results.json").write_text(json.dumps({"runs": [{"val_score": 0.3}],
                                                           "summary": _summary({"ushash": {64: (0.2, 0.4)}})}))
    (stamps / f"{r.ablation_step('a', 0)}.json").write_text((stamps / "s2.json").read_text())
    body = r.ablation_body()
    assert "2 x86_64 cores (AMD EPYC), no GPU, torch 2.14.1" in body and "publishing" not in body


def test_search_trials_read_against_a_naive_reading():
    """The search table's reading column: distinct val scores, the val-test paired correlation over the trials
    (against the textbook formula), the best test paired trial (the first of a tie); none without spread."""
    r = _reproduce()
    val, paired = [0.30, 0.32, 0.32, 0.29, 0.35], [0.20, 0.26, 0.21, 0.22, 0.26]
    trials = [{"number": i, "val_score": v, "test": {"paired": p}} for i, (v, p) in enumerate(zip(val, paired))]
    mv, mp = sum(val) / 5, sum(paired) / 5
    cov = sum((v - mv) * (p - mp) for v, p in zip(val, paired))
    corr = cov / (sum((v - mv) ** 2 for v in val) * sum((p - mp) ** 2 for p in paired)) ** 0.5
    assert r.trials_read(trials) == f"4; {corr:.2f}; 1"
    same = [{"number": i, "val_score": 0.3, "test": {"paired": p}} for i, p in enumerate(paired)]
    assert r.trials_read(same) == "1; –; 1"


def test_previous_recipe_block_has_a_row_per_set_length_and_recipe(tmp_path, monkeypatch):
    """The recipe against the previous one: the shipped runs of the 64-bit and the bits experiments beside the
    previous recipe's variants, one row per (set, length, recipe), val means from the runs themselves."""
    r = _reproduce()
    monkeypatch.setattr(r, "ROOT", tmp_path)
    monkeypatch.setattr(r, "ABLATION_SETS", {"a": ("sweep_a64", "a-64b")})
    monkeypatch.setattr(r, "BITS_SETS", {"a": ("sweep_a", "a-bits")})
    from ushash.evaluation.sweep import variant_dir

    def write(folder, bits, v):
        runs = [{"method": "ushash", "bits": b, "seed": s, "val_score": v + 0.01 * s, "val_scores": [0.1] * 5 + [v] * 3}
                for b in bits for s in range(3)]
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(
            {"runs": runs, "summary": _summary({"ushash": {b: (0.2, 0.4) for b in bits}})}))

    exp = tmp_path / "experiments"
    write(exp / "a-64b", [64], 0.40)
    write(variant_dir(exp / "a-64b", r.PREVIOUS_RECIPE), [64], 0.38)
    write(exp / "a-bits", [16, 32, 64, 128], 0.30)
    write(variant_dir(exp / "a-bits", r.PREVIOUS_BITS), [16, 32, 128], 0.28)
    rows = [line for line in r.previous_recipe_body().splitlines() if line.startswith("| a |")]
    assert [row.split(" | ")[1:3] for row in rows] == [
        [b, label] for b in ("64", "16", "32", "128") for label in ("shipped", r.PREVIOUS_LABEL)]
    assert rows[0].split(" | ")[4] == "0.4100 ± 0.0100" and rows[1].split(" | ")[4] == "0.3900 ± 0.0100"
    assert rows[2].split(" | ")[4:6] == ["0.3100 ± 0.0100", "0.3000 ± 0.0000"]


def test_recheck_block_applies_the_rule_against_the_defaults_spread(tmp_path, monkeypatch):
    """The ablation's gains over 3 seeds: each rechecked row's gain in mean val over the defaults' runs, beside
    the defaults' seed std; it passes only when higher on every set by more than that std; and a row the one-seed
    ablation puts higher on both sets that RECHECK lacks is named."""
    r = _reproduce()
    monkeypatch.setattr(r, "ROOT", tmp_path)
    monkeypatch.setattr(r, "ABLATION_SETS", {"a": ("sweep_a64", "a-64b"), "b": ("sweep_b64", "b-64b")})
    monkeypatch.setattr(r, "ABLATIONS", {"shipped defaults": "", "wide (x=1)": "x=1", "narrow (x=2)": "x=2",
                                         "other (y=1)": "y=1"})
    monkeypatch.setattr(r, "RECHECK", ("wide (x=1)", "narrow (x=2)"))
    from ushash.evaluation.sweep import variant_dir

    def write(folder, vals):
        runs = [{"method": "ushash", "bits": 64, "seed": s, "val_score": v, "val_scores": [0.1] * 5 + [v]}
                for s, v in enumerate(vals)]
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps({"runs": runs, "summary": _summary({"ushash": {64: (0.2, 0.4)}})}))

    exp = tmp_path / "experiments"
    for d, gain_wide in (("a", 0.03), ("b", 0.02)):   # the defaults' std: 0.01 on both sets
        write(exp / f"{d}-64b", [0.39, 0.40, 0.41])
        write(variant_dir(exp / f"{d}-64b", r.recheck_overrides("wide (x=1)")), [0.40 + gain_wide] * 3)
        write(variant_dir(exp / f"{d}-64b", r.recheck_overrides("narrow (x=2)")), [0.405, 0.41, 0.415])  # +0.01
        for label, v in (("shipped defaults", 0.40), ("wide (x=1)", 0.42), ("narrow (x=2)", 0.39), ("other (y=1)", 0.41)):
            write(variant_dir(exp / f"{d}-64b", r.ablation_overrides(label)), [v])
    body = r.recheck_body()
    rows = {tuple(line.split(" | ")[:2]): line.split(" | ") for line in body.splitlines() if line.startswith("| ")}
    assert rows[("| shipped defaults", "a")][3:5] == ["0.400 ± 0.010", "–"]
    assert rows[("| wide (x=1)", "a")][3:5] == ["0.430 ± 0.000", "+0.030 (0.010)"]
    assert rows[("| narrow (x=2)", "b")][4] == "+0.010 (0.010)"
    assert "- wide (x=1): passes (a +0.030 against 0.010, b +0.020 against 0.010)" in body
    assert "- narrow (x=2): does not pass" in body   # a gain equal to the spread is not beyond it
    assert "not rechecked here: other (y=1)." in body   # higher on both sets with one seed, not in RECHECK
    # nothing run: no block
    monkeypatch.setattr(r, "ABLATION_SETS", {"c": ("sweep_c64", "c-64b")})
    assert r.recheck_body() is None


def test_split_block_gives_each_splits_margins_and_their_range(tmp_path, monkeypatch):
    """What another split moves: a row per split (the published experiment is split 0, each other data.seed its
    variant) with the bars' margins, then their mean and range over the splits; a set with one split is left out."""
    r = _reproduce()
    monkeypatch.setattr(r, "ROOT", tmp_path)
    monkeypatch.setattr(r, "SPLIT_SETS", {"a": ("sweep_a64", "a-64b"), "b": ("sweep_b64", "b-64b")})
    monkeypatch.setattr(r, "SPLIT_SEEDS", (1, 2))
    from ushash.evaluation.sweep import variant_dir

    def write(folder, us, itq, flt, label_gap):
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps({"n_rows_test": {"image": 40}, "summary": _summary(
            {"ushash": {64: (us, 0.5 + label_gap)}, "itq": {64: (itq, 0.5)}, "float": {64: (flt, 0.6)}})}))

    exp = tmp_path / "experiments"
    write(exp / "a-64b", 0.30, 0.28, 0.32, 0.01)
    write(variant_dir(exp / "a-64b", r.split_overrides(1)), 0.25, 0.26, 0.30, -0.02)
    write(variant_dir(exp / "a-64b", r.split_overrides(2)), 0.33, 0.30, 0.36, 0.04)
    write(exp / "b-64b", 0.3, 0.3, 0.3, 0.0)   # no other split: no rows
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in r.split_body().splitlines()
            if line.startswith(("| a |", "| **a**"))]
    assert [row[1] for row in rows] == ["0 (published)", "1", "2", "**3 splits: mean (range)**"]
    assert rows[0][2:] == ["40", "0.300", "0.280", "+0.020 (s.e. 0.008)", "0.320", "0.94x", "+0.010 (s.e. 0.008)"]
    assert rows[1][5] == "-0.010 (s.e. 0.008)" and rows[1][7] == "0.83x"
    assert rows[3][5] == "**+0.013 (-0.010 to +0.030)**" and rows[3][8] == "**+0.010 (-0.020 to +0.040)**"
    assert not any(line.startswith("| b |") for line in r.split_body().splitlines())


def test_search_split_block_sets_each_choice_against_the_defaults_split_by_split(tmp_path, monkeypatch):
    """A choice on its own set's published split reads its search report; on the other set's, the cross variant;
    on other splits, its split variant beside the defaults' split runs; the gain is the difference of the mean val
    scores, then its mean and range over the splits."""
    r = _reproduce()
    monkeypatch.setattr(r, "ROOT", tmp_path)
    monkeypatch.setattr(r, "SEARCH_SETS", {"a": "sweep_a64", "b": "sweep_b64"})
    monkeypatch.setattr(r, "_SEARCH", {"a": ("sweep_a64", "a-64b"), "b": ("sweep_b64", "b-64b")})
    monkeypatch.setattr(r, "SPLIT_SEEDS", (1,))
    from ushash.evaluation.sweep import variant_dir

    def report(chosen_val, default_val):
        side = lambda v: {"val_score": v, "test": [{"paired": 0.2}] * len(v)}
        return {"over_seeds": {"chosen": side(chosen_val), "defaults": side(default_val)}}

    reports = {"a": report([0.42, 0.44, 0.46], [0.40, 0.40, 0.40]), "b": None}
    monkeypatch.setattr(r, "set_search", lambda d, method="ushash": reports[d])
    monkeypatch.setattr(r, "cross_overrides", lambda to, choice=None, seed=0: (
        choice, ["method=ushash", "seed=0,1,2", *([f"data.seed={seed}"] if seed else []), f"x={choice}"]))

    def write(folder, vals, paired=0.25):
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps({"runs": [
            {"method": "ushash", "seed": i, "val_score": v} for i, v in enumerate(vals)],
            "summary": _summary({"ushash": {64: (paired, 0.5)}})}))

    exp = tmp_path / "experiments" / "a-64b"
    write(variant_dir(exp, r.cross_overrides("a", "a", 1)[1]), [0.39, 0.40, 0.41], paired=0.26)
    write(variant_dir(exp, r.split_overrides(1)), [0.40, 0.41, 0.42], paired=0.24)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in r.search_split_body().splitlines()
            if line.startswith(("| a's", "| **a's"))]
    assert rows[0] == ["a's", "a", "0 (published)", "0.440 ± 0.020", "0.400 ± 0.000", "+0.040", "0.200 / 0.200"]
    assert rows[1] == ["a's", "a", "1", "0.400 ± 0.010", "0.410 ± 0.010", "-0.010", "0.260 / 0.240"]
    assert rows[2][2] == "**2 splits: mean (range)**" and rows[2][5] == "**+0.015 (-0.010 to +0.040)**"
    assert len(rows) == 3   # b has no report: a's choice has no published row there and no split run: no rows


def _writer(tmp_path):
    """A script a test step runs: `python write.py FILE TEXT` writes TEXT to FILE (its folders made)."""
    write = tmp_path / "write.py"
    write.write_text("import sys, pathlib\np = pathlib.Path(sys.argv[1]); p.parent.mkdir(parents=True, exist_ok=True)\n"
                     "p.write_text(sys.argv[2])\n")
    return write


def _isolated(tmp_path, monkeypatch, **tables):
    """scripts/reproduce.py run in `tmp_path`, on a test CPU, with only the steps and blocks given (every other
    table of steps and blocks empty)."""
    r = _reproduce()
    monkeypatch.setattr(r, "ROOT", tmp_path)
    monkeypatch.setattr(r, "machine", lambda: "2 x86_64 cores (test CPU), no GPU")
    for table in ("STEPS", "NEEDS", "SWEEP_BLOCKS", "PRINTED_BLOCKS", "RESULT_BLOCKS", "VARIANT_STEPS", "SEARCH_STEPS",
                  "CROSS_STEPS", "MADE_BLOCKS", "PRODUCES"):
        monkeypatch.setattr(r, table, tables.get(table, {}))
    return r


def test_publish_writes_nothing_while_results_are_not_the_ones_their_stamps_describe(tmp_path, monkeypatch):
    """A results file rewritten outside reproduce, or downstream results made from an upstream step's earlier
    results (budget_heads run again under the cache benchmarks), stop publish before it writes any block."""
    write = _writer(tmp_path)
    r = _isolated(tmp_path, monkeypatch,
                  STEPS={"heads": f"python {write} experiments/heads/results.md heads-A",
                         "bench": f"python {write} experiments/bench/results.md bench-1"},
                  NEEDS={"bench": ["heads"]},
                  RESULT_BLOCKS={"heads": ("doc.md", "heads", "experiments/heads/results.md"),
                                 "bench": ("doc.md", "bench", "experiments/bench/results.md")})
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- reproduce:heads -->\nold\n<!-- /reproduce:heads -->\n<!-- reproduce:bench -->\nold\n"
                   "<!-- /reproduce:bench -->\n")

    # results with no stamp at all (a command run by hand): refused, nothing written
    r.run_step("heads")
    (tmp_path / "experiments" / "reproduce" / "heads.json").unlink()
    try:
        r.publish()
        raise AssertionError("publish wrote results no stamp describes")
    except SystemExit as e:
        assert "heads: no stamp" in str(e) and "./run reproduce heads" in str(e)
    assert "old" in doc.read_text() and "heads-A" not in doc.read_text()

    r.run_step("heads")
    r.run_step("bench")
    stamp = json.loads((tmp_path / "experiments" / "reproduce" / "bench.json").read_text())
    assert list(stamp["outputs"]) == ["experiments/bench/results.md"]
    assert list(stamp["made_from"]) == ["heads"]
    r.publish()
    text = doc.read_text()
    assert "heads-A" in text and "bench-1" in text and "test CPU" in text and "old" not in text

    # the upstream results rewritten by hand: the stamp does not describe them
    (tmp_path / "experiments" / "heads" / "results.md").write_text("heads-B")
    try:
        r.publish()
        raise AssertionError("publish wrote results their stamp does not describe")
    except SystemExit as e:
        msg = str(e)
        assert "heads: experiments/heads/results.md changed since its run" in msg
        assert "bench: it was made from other heads results than the ones here" in msg
        assert msg.endswith("rerun: ./run reproduce heads bench")
    assert doc.read_text() == text

    # the upstream step run again with other results: the downstream step was made from the earlier ones
    monkeypatch.setitem(r.STEPS, "heads", f"python {write} experiments/heads/results.md heads-B")
    r.run_step("heads")
    try:
        r.publish()
        raise AssertionError("publish wrote a benchmark of other heads beside the new heads' table")
    except SystemExit as e:
        assert "bench: it was made from other heads results than the ones here" in str(e)
        assert str(e).endswith("rerun: ./run reproduce bench")
    assert doc.read_text() == text

    r.run_step("bench")
    r.publish()
    assert "heads-B" in doc.read_text() and "heads-A" not in doc.read_text()

    # a failed run's stamp does not describe the results left from before it
    monkeypatch.setitem(r.STEPS, "bench", f"python {tmp_path / 'missing.py'}")
    try:
        r.run_step("bench")
    except SystemExit:
        pass
    try:
        r.publish()
        raise AssertionError("publish stamped old results with a failed run")
    except SystemExit as e:
        assert "bench: its last run" in str(e) and "failed with exit" in str(e)


def test_a_search_over_splits_whose_report_changed_is_not_published_under_its_old_stamp(tmp_path, monkeypatch):
    """The searches over splits were missing from the steps `unstamped` checks: their report edited by hand was
    published under the stamp (date, machine) of the run that made the old one. Every step with results is checked."""
    write = _writer(tmp_path)
    r = _isolated(tmp_path, monkeypatch,
                  STEPS={"search_splits": f"python {write} experiments/search/splits-a/search.md trials-A"})
    monkeypatch.setattr(r, "SPLITS_SPACES", ("search",))
    monkeypatch.setattr(r, "splits_report", lambda space: {"folder": "experiments/search/splits-a"})
    r.run_step("search_splits")
    assert r.unstamped() == ([], [])
    (tmp_path / "experiments" / "search" / "splits-a" / "search.md").write_text("trials-B")
    problems, steps = r.unstamped()
    assert steps == ["search_splits"] and "search.md changed since its run" in problems[0]


def test_a_checkpoint_trained_again_marks_the_steps_made_from_the_old_one(tmp_path, monkeypatch):
    """The demo's checkpoint and export are not committed, and the steps that read them (the export, the cache
    simulation, the payload benchmark) recorded nothing of them: the demo trained again on another machine left
    their blocks standing, made from the old checkpoint. Their digests now go into the stamps (PRODUCES)."""
    write = _writer(tmp_path)
    r = _isolated(tmp_path, monkeypatch,
                  STEPS={"train": f"python {write} checkpoints/best.ckpt weights-A",
                         "bench": f"python {write} experiments/bench/results.md bench-1"},
                  NEEDS={"bench": ["train"]}, PRODUCES={"train": ["checkpoints/best.ckpt"]},
                  RESULT_BLOCKS={"bench": ("doc.md", "bench", "experiments/bench/results.md")})
    r.run_step("train")
    r.run_step("bench")
    stamps = tmp_path / "experiments" / "reproduce"
    assert list(json.loads((stamps / "train.json").read_text())["produced"]) == ["checkpoints/best.ckpt"]
    assert r.unstamped() == ([], [])
    # resumed with the same checkpoint: its stamp is kept, nothing is stale
    r.run_step("train")
    assert r.unstamped() == ([], [])
    # trained again, another checkpoint: the benchmark was made from the old one
    monkeypatch.setitem(r.STEPS, "train", f"python {write} checkpoints/best.ckpt weights-B")
    r.run_step("train")
    problems, steps = r.unstamped()
    assert steps == ["bench"] and "made from other train results" in problems[0]
    r.run_step("bench")
    assert r.unstamped() == ([], [])
    # the checkpoint trained again by hand (the README's first command does): the stamps still describe the
    # published results, and a step that reads the new checkpoint is marked once it ran
    (tmp_path / "checkpoints" / "best.ckpt").write_text("weights-C")
    assert r.unstamped() == ([], [])
    r.run_step("bench")
    problems, steps = r.unstamped()
    assert steps == ["bench"] and "made from other train results" in problems[0]
    # a clone holds no checkpoint: the stamps alone are compared
    (tmp_path / "checkpoints" / "best.ckpt").unlink()
    r.run_step("bench")
    assert "made from other train results" in r.unstamped()[0][0]


def test_a_step_that_repeats_its_results_keeps_the_stamp_of_the_run_that_made_them(tmp_path, monkeypatch):
    """A step asked for by another (its NEEDS) resumes in seconds: its stamp once took that resume's wall time,
    and the published table said a 28-minute benchmark ran in 3 s. Results byte for byte the same keep the stamp
    and the log; other results, another command or a failure are stamped anew."""
    write = tmp_path / "write.py"
    write.write_text("import sys, pathlib\np = pathlib.Path(sys.argv[1]); p.parent.mkdir(parents=True, exist_ok=True)\n"
                     "p.write_text(sys.argv[2]); print('made', sys.argv[2])\n")
    r = _isolated(tmp_path, monkeypatch, STEPS={"heads": f"python {write} experiments/heads/results.md A"},
                  RESULT_BLOCKS={"heads": ("doc.md", "heads", "experiments/heads/results.md")})
    stamp, log = (tmp_path / "experiments" / "reproduce" / f"heads.{x}" for x in ("json", "log"))
    r.run_step("heads")
    first = json.loads(stamp.read_text())
    first["wall_s"] = 1696.1                            # as a long first run would have recorded
    stamp.write_text(json.dumps(first))
    log.write_text(log.read_text() + "the first run's log\n")
    first["log_sha256"] = hashlib.sha256(log.read_bytes()).hexdigest()
    stamp.write_text(json.dumps(first))
    r.run_step("heads")                                 # the same results: the stamp and the log stay
    assert json.loads(stamp.read_text()) == first and "the first run's log" in log.read_text()
    assert not log.with_name("heads.new.log").exists()
    monkeypatch.setitem(r.STEPS, "heads", f"python {write} experiments/heads/results.md B")
    r.run_step("heads")                                 # other results: a new stamp
    again = json.loads(stamp.read_text())
    assert again["wall_s"] < 1696.1 and again["outputs"] != first["outputs"] and "made B" in log.read_text()
    monkeypatch.setitem(r.STEPS, "heads", f"python {write}  experiments/heads/results.md B")
    r.run_step("heads")                                 # the same results by another command: stamped with it
    assert json.loads(stamp.read_text())["command"] == r.STEPS["heads"]


def test_a_step_without_result_files_that_prints_the_same_log_keeps_its_stamp(tmp_path, monkeypatch):
    """A step that writes no published file (a data set's fetch, asked for by the steps that read it) made its
    log: run again as another step's NEEDS with the same log, its stamp stays (it was dated anew on every run,
    a change to commit that recorded nothing new); another log is stamped anew."""
    say = tmp_path / "say.py"
    say.write_text("import sys\nprint('kept', sys.argv[1], 'drawings')\n")
    r = _isolated(tmp_path, monkeypatch, STEPS={"fetch": f"python {say} 10"})
    stamp, log = (tmp_path / "experiments" / "reproduce" / f"fetch.{x}" for x in ("json", "log"))
    r.run_step("fetch")
    first = json.loads(stamp.read_text())
    assert first["outputs"] == {} and first["log_sha256"] == hashlib.sha256(log.read_bytes()).hexdigest()
    first["date"], first["wall_s"] = "2026-01-01", 99.0   # as an earlier day's run would have recorded
    stamp.write_text(json.dumps(first))
    log.unlink()                                          # logs are not committed: a fresh clone has none
    r.run_step("fetch")
    assert json.loads(stamp.read_text()) == first and log.read_text() == "kept 10 drawings\n"
    assert not log.with_name("fetch.new.log").exists()
    monkeypatch.setitem(r.STEPS, "fetch", f"python {say} 11")
    r.run_step("fetch")                                   # another command
    assert json.loads(stamp.read_text())["date"] != "2026-01-01"
    again = json.loads(stamp.read_text())
    say.write_text("import sys\nprint('kept', sys.argv[1], 'drawings, 3 dropped')\n")
    r.run_step("fetch")                                   # the same command, another log
    assert json.loads(stamp.read_text())["log_sha256"] != again["log_sha256"] and "dropped" in log.read_text()


def test_a_printed_block_is_published_only_from_a_log_its_stamp_describes(tmp_path, monkeypatch):
    """A printed block (a benchmark's table, the demo's) is the step's log: a failed or interrupted rerun once
    left its partial output there, and publish printed it under the last good run's stamp."""
    bench = tmp_path / "bench.py"
    bench.write_text("import sys\nprint('| a | 100 |')\nif sys.argv[1] == 'fail':\n    sys.exit(3)\n"
                     "print('| b | 200 |')\n")
    r = _isolated(tmp_path, monkeypatch, STEPS={"bench": f"python {bench} ok"},
                  PRINTED_BLOCKS={"bench": ("doc.md", "bench")})
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- reproduce:bench -->\nold\n<!-- /reproduce:bench -->\n")
    r.run_step("bench")
    r.publish()
    good = doc.read_text()
    assert "| b | 200 |" in good and "test CPU" in good
    monkeypatch.setitem(r.STEPS, "bench", f"python {bench} fail")
    with pytest.raises(SystemExit, match="bench failed"):
        r.run_step("bench")
    log = tmp_path / "experiments" / "reproduce" / "bench.log"
    assert "| b | 200 |" in log.read_text()          # the last good run's log is kept
    r.publish()
    assert doc.read_text() == good                     # and the block with it: not published under a failed stamp
    monkeypatch.setitem(r.STEPS, "bench", f"python {bench} ok")
    r.run_step("bench")
    log.write_text("| a | 1 |\n")                     # a log its stamp does not describe
    r.publish()
    assert doc.read_text() == good


def test_reaggregate_remakes_a_sweeps_tables_from_its_runs_and_says_so(tmp_path, monkeypatch):
    """`./run reproduce reaggregate`: a step whose results are the ones its stamp describes gets its tables
    from the aggregation code here, and its stamp records it (publish then accepts them and says so); a step
    whose results were changed by hand, or whose runs are not all on disk, is left as it is."""
    from ushash.evaluation import sweep

    r = _reproduce()
    monkeypatch.setattr(r, "ROOT", tmp_path)
    monkeypatch.setattr(r, "machine", lambda: "2 x86_64 cores (test CPU), no GPU")
    write = tmp_path / "write.py"
    write.write_text("import sys, pathlib, json\np = pathlib.Path(sys.argv[1]); p.mkdir(parents=True, exist_ok=True)\n"
                     "(p / 'results.md').write_text(sys.argv[2]); (p / 'results.json').write_text(json.dumps("
                     "{'tie_rule': 'x', 'v': sys.argv[2]}))\n")
    monkeypatch.setattr(r, "STEPS", {"sa": f"python {write} experiments/a a-1", "sb": f"python {write} experiments/b b-1"})
    monkeypatch.setattr(r, "SWEEP_BLOCKS", {"a": ("doc.md", "a", "sa"), "b": ("doc.md", "b", "sb")})
    for table in ("RESULT_BLOCKS", "PRINTED_BLOCKS", "VARIANT_STEPS", "SEARCH_STEPS", "CROSS_STEPS", "MADE_BLOCKS",
                  "NEEDS"):
        monkeypatch.setattr(r, table, {})
    calls = []

    def aggregate(exp, out_dir=None):
        calls.append(out_dir.name)
        if out_dir.name == "b" and (out_dir / "gone").exists():
            raise FileNotFoundError("1 of the grid's 1 runs have no readable result")
        (out_dir / "results.md").write_text((out_dir / "results.md").read_text() + " again")

    monkeypatch.setattr(sweep, "aggregate", aggregate)
    r.run_step("sa")
    r.run_step("sb")
    before = r.stamp_record("sa")
    assert r.reaggregate() == ["sa", "sb"] and calls == ["a", "b"]
    after = r.stamp_record("sa")
    assert (tmp_path / "experiments/a/results.md").read_text() == "a-1 again"
    assert after["aggregated"]["code"] and after["command"] == before["command"] and after["date"] == before["date"]
    assert r.unstamped() == ([], [])
    assert "tables re-aggregated from those runs on " in r.stamp_of("sa") and "`./run reproduce reaggregate`" in r.made_on(["sa"])

    (tmp_path / "experiments/a/results.md").write_text("edited by hand")
    (tmp_path / "experiments/b/gone").write_text("")
    calls.clear()
    stamp_b = r.stamp_record("sb")
    assert r.reaggregate() == [] and calls == ["b"]
    assert (tmp_path / "experiments/a/results.md").read_text() == "edited by hand"
    assert r.stamp_record("sb") == stamp_b and r.unstamped()[1] == ["sa"]


def test_the_committed_stamps_describe_the_committed_results():
    """Every published result on disk is the one its stamp recorded (so ./run reproduce publish can run)."""
    problems, steps = _reproduce().unstamped()
    assert not problems, "\n".join(problems) + f"\nrerun: ./run reproduce {' '.join(steps)}"


def test_every_result_a_stamp_names_is_committed():
    """A stamp's outputs are what publish reads: one left untracked is on the disk that made it and missing
    from every clone, where publish drops what it would have shown."""
    import subprocess

    named = sorted({f for stamp in (ROOT / "experiments" / "reproduce").glob("*.json")
                    for f in (json.loads(stamp.read_text()).get("outputs") or {})})
    if not (ROOT / ".git").exists():
        return   # not a checkout: nothing to compare with
    tracked = set(subprocess.run(["git", "ls-files", "-z", "--", *named], cwd=ROOT, capture_output=True,
                                 check=True).stdout.decode().split("\0"))
    assert [f for f in named if f not in tracked] == []


def test_a_variant_steps_results_are_its_variant_folders():
    from ushash.evaluation.sweep import variant_dir

    r = _reproduce()
    step = r.ablation_step("tuxpaint", 1)
    folder = variant_dir(r.ROOT / "experiments" / "tuxpaint-offline-64b", r.ablation_overrides(list(r.ABLATIONS)[1]))
    rel = folder.relative_to(r.ROOT)
    assert r.outputs_of(step) == [str(rel / "results.json"), str(rel / "results.md")]
    assert r.outputs_of("trained_bits_emoji")[0].startswith("experiments/emoji-offline-bits/variants/")
    assert r.outputs_of("budget_heads") == ["experiments/budget-heads/results.json", "experiments/budget-heads/results.md"]


def test_the_search_steps_results_are_their_reports():
    r = _reproduce()
    for step, (dataset, method) in r.SEARCH_STEPS.items():
        rep = r.set_search(dataset, method)
        if rep is not None:   # a report names its folder relative to the root
            assert r.outputs_of(step) == [f"{rep['folder']}/search.json", f"{rep['folder']}/search.md"]


def test_no_committed_file_names_the_checkouts_own_path():
    """Results and reports are written relative to the root: a committed file naming where this checkout lies
    would name one machine's paths (a search report once recorded its absolute folder)."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    needle = str(ROOT).encode()
    named = [f.decode() for f in files if f and (ROOT / f.decode()).is_file()
             and needle in (ROOT / f.decode()).read_bytes()]
    assert named == [], f"these committed files name {ROOT}: {named}"
