"""lm-evaluation-harness against the real server, as evaluators run it: `local-completions` scores
a multiple-choice task by loglikelihood (echo with max_tokens 0, prompt logprobs) and
`local-chat-completions` runs a generate_until task, neither given a `tokenizer=` (the remote
tokenizer backend reads /tokenizer_info and /tokenize)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from server_utils import TINY_MODEL_NAME as MODEL

lm_eval = pytest.importorskip("lm_eval")  # in the test extra; CI installs it

pytestmark = pytest.mark.slow

DOCS = [{"question": f"Question {i}: pick one.", "choices": [" alpha", " beta", " gamma"],
         "label": i % 3, "answer": "alpha"} for i in range(4)]


def _tasks(tmp_path: Path) -> Path:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              "test_split: test\ndoc_to_text: \"{{question}}\"\n")
    (tmp_path / "ll.yaml").write_text(
        "task: peregrine_tiny_choice\n" + common + "output_type: multiple_choice\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{label}}\"\n"
        "metric_list:\n  - metric: acc\n")
    (tmp_path / "gen.yaml").write_text(
        "task: peregrine_tiny_generate\n" + common + "output_type: generate_until\n"
        "doc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return tmp_path


def _evaluate(model: str, model_args: str, task: str, tasks_dir: Path, **kw) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=[task],
                          task_manager=TaskManager(include_path=str(tasks_dir)), limit=len(DOCS),
                          log_samples=True, **kw)
    return out


def test_loglikelihood_task_through_local_completions(real_server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = _tasks(tmp_path)
    args = (f"base_url={real_server.base_url}/v1/completions,model={MODEL},"
            "tokenizer_backend=remote,num_concurrent=1,max_retries=1")
    out = _evaluate("local-completions", args, "peregrine_tiny_choice", tasks)
    samples = out["samples"]["peregrine_tiny_choice"]
    assert len(samples) == len(DOCS)
    for s in samples:  # one finite log-likelihood per choice
        lls = [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in s["resps"]]
        assert len(lls) == 3 and all(math.isfinite(x) and x < 0 for x in lls)
    assert 0.0 <= out["results"]["peregrine_tiny_choice"]["acc,none"] <= 1.0


def test_generate_until_task_through_local_chat_completions(real_server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = _tasks(tmp_path)
    args = (f"base_url={real_server.base_url}/v1/chat/completions,model={MODEL},"
            "num_concurrent=1,max_retries=1")
    out = _evaluate("local-chat-completions", args, "peregrine_tiny_generate", tasks,
                    apply_chat_template=True)
    samples = out["samples"]["peregrine_tiny_generate"]
    assert len(samples) == len(DOCS)
    assert all(isinstance(s["resps"][0][0], str) for s in samples)
    assert "exact_match,none" in out["results"]["peregrine_tiny_generate"]
