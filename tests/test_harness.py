"""The lm-eval adapter (spmd.io.harness): log-likelihoods equal to what transformers computes on the
same imported model (fixture made by transformers: tests/fixtures/make_lmeval_fixture.py), on one device
and sharded, and lm-eval's own evaluator running local task definitions through it (no network)."""

import json
import pathlib

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from spmd.core.errors import UserError  # noqa: E402
from spmd.io import harness, hf  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "chat"
REFERENCE = json.loads((FIXTURES / "loglikelihood.json").read_text())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("harness") / "run"
    hf.import_hf(str(FIXTURES / "llama-chat"), str(out), overrides=["model.dtype=float32"])
    return out


def requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.parametrize("mesh", ["fsdp=8", "data=2;fsdp=2;tensor=2"])
def test_loglikelihoods_equal_transformers(run_dir, mesh):
    lm = harness.SpmdLM(str(run_dir), mesh=mesh, rules="fsdp_tp" if "tensor" in mesh else None, batch_size=4)
    assert lm.prefix_token_id == REFERENCE["prefix_token_id"]
    pairs = [(r["context"], r["continuation"]) for r in REFERENCE["loglikelihood"]]
    got = lm.loglikelihood(requests("loglikelihood", pairs), disable_tqdm=True)
    for (logprob, greedy), want in zip(got, REFERENCE["loglikelihood"]):
        assert logprob == pytest.approx(want["logprob"], rel=1e-5, abs=1e-5) and greedy == want["greedy"]
    rolling = lm.loglikelihood_rolling(
        requests("loglikelihood_rolling", [(r["text"],) for r in REFERENCE["rolling"]])
    )
    assert rolling == pytest.approx([r["logprob"] for r in REFERENCE["rolling"]], rel=1e-5, abs=1e-5)


def test_a_long_document_rolls_over_windows_that_cover_it_once(run_dir, monkeypatch):
    """Past max_length a document is scored in lm-eval's rolling windows: each token predicted
    exactly once, no row longer than the context, the windows' log-probabilities summed."""
    lm = harness.SpmdLM(str(run_dir), mesh="fsdp=8", batch_size=2, max_length=8)
    text = "the quick brown fox jumps over the lazy dog; seven is prime and two is the only even prime."
    ids = lm.tok_encode(text)
    seen = []
    score_rows = lm.score_rows

    def recording(rows):
        seen.extend(rows)
        return score_rows(rows)

    monkeypatch.setattr(lm, "score_rows", recording)
    (whole,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    assert len(ids) > 2 * 8 and sum(n for _, n in seen) == len(ids)
    assert all(len(row) <= 8 + 1 for row, _ in seen)
    assert [t for row, n in seen for t in row[-n:]] == ids  # in order, each once
    assert whole == pytest.approx(sum(logprob for logprob, _ in score_rows(seen)), rel=1e-6)


def write_tasks(root: pathlib.Path) -> pathlib.Path:
    data = root / "arith.jsonl"
    rows = [
        {"question": "What is 2 + 2?", "choices": [" 4", " 5"], "answer": 0},
        {"question": "The quick brown fox", "choices": [" jumps over the lazy dog", " time"], "answer": 0},
        {
            "question": "a prime number has exactly two divisors;",
            "choices": [" seven is prime", " 4"],
            "answer": 0,
        },
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tasks = root / "tasks"
    tasks.mkdir()
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (tasks / "spmd_arith.yaml").write_text(
        "task: spmd_arith\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    (tasks / "spmd_arith_gen.yaml").write_text(
        "task: spmd_arith_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{choices[answer]}}'\ngeneration_kwargs:\n  until: ['.']\n  max_gen_toks: 8\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return tasks


def test_lm_eval_runs_local_tasks_through_the_adapter(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    tasks = write_tasks(tmp_path)
    args = {"run_dir": str(run_dir), "mesh": "fsdp=8"}
    results = harness.evaluate(args, ["spmd_arith", "spmd_arith_gen"], None, 0, str(tasks), batch_size=4)
    # accuracy: the choice transformers scores higher, per question (the fixture's numbers)
    scores = {(r["context"], r["continuation"]): r["logprob"] for r in REFERENCE["loglikelihood"]}
    rows = [json.loads(line) for line in (tmp_path / "arith.jsonl").read_text().splitlines()]
    want = sum(
        max(range(2), key=lambda c: scores[(row["question"], row["choices"][c])]) == row["answer"]
        for row in rows
    ) / len(rows)
    assert results["results"]["spmd_arith"]["acc,none"] == pytest.approx(want)
    assert "exact_match,none" in results["results"]["spmd_arith_gen"]
    with pytest.raises(UserError, match="no lm-eval task named 'no_such_task'"):
        harness.evaluate(args, ["no_such_task"], None, 0, str(tasks), batch_size=4)


def test_spmd_eval_tasks_errors_are_one_line(run_dir, tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "spmd.cli.eval", "--run-dir", str(run_dir), "--tasks", "no_such_task",
         "--include-path", str(write_tasks(tmp_path))],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("error: no lm-eval task named 'no_such_task'")
    assert done.stderr.count("\n") == 1


def test_a_continuation_longer_than_the_window_is_scored_on_its_tail(run_dir):
    lm = harness.SpmdLM(str(run_dir), mesh="fsdp=8", batch_size=2, max_length=8)
    continuation = " the quick brown fox jumps over the lazy dog and over the lazy dog again"
    context_ids, continuation_ids = lm._encode_pair("What is", continuation)
    assert len(continuation_ids) > 9
    ((got, _),) = lm.loglikelihood(requests("loglikelihood", [("What is", continuation)]), disable_tqdm=True)
    whole = (context_ids + continuation_ids)[-9:]
    assert got == pytest.approx(
        lm.score_rows([(whole, 8)])[0][0], rel=1e-6
    )  # all 8 positions, all continuation
