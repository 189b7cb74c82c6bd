"""The language tasks' prompts: default templates, label words and lengths, and the fields a template names."""

from __future__ import annotations

CLASSIFICATION = {
    "sst2": {"template": "{sentence} It was", "label_words": (" terrible", " great"), "max_length": 32},
    "qqp": {"template": "Question 1: {question1}\nQuestion 2: {question2}\n"
                        "Do both questions ask the same thing? Answer:",
            "label_words": (" No", " Yes"), "max_length": 128},
    # your own files (hiso.tasks.text): label words default to the labels themselves, " <label>"
    "text": {"template": "{text}\nAnswer:", "label_words": None, "max_length": 128},
}
# SQuAD: 640 tokens keep every prompt of the shared files whole (the longest is 631; the authors
# allow 2,048); 256 cut the gold answer out of the context of 3-4 % of questions, for 5 % less time (2-core AMD EPYC)
QA = {"squad": {"template": "Context: {context}\nQuestion: {question}\nAnswer:", "max_length": 640},
      "instruct": {"template": "{prompt}\nAnswer:", "max_length": 256}}
LANGUAGE_TASKS = tuple(CLASSIFICATION) + tuple(QA)
# which placeholders a template may use, per task, and the example field each one reads
_FIELDS = {"sst2": {"sentence": "text_a"}, "qqp": {"question1": "text_a", "question2": "text_b"},
           "squad": {"context": "context", "question": "question"},
           "text": {"text": "text_a"}, "instruct": {"prompt": "question"}}


def _check_template(task: str, template: str) -> None:
    try:
        template.format(**{k: "x" for k in _FIELDS[task]})
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"template for {task} may use {{{'}, {'.join(_FIELDS[task])}}} only; "
                         f"{template!r} fails ({e!r})") from None
