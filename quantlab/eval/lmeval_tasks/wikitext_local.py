"""Functions of the `wikitext_local` lm-eval task (wikitext_local.yaml; lm-eval loads this file by its path).

The detokenizer and process_results are lm-eval's own (its `wikitext` task), imported so they cannot drift;
only the documents come from here: quantlab's local WikiText-2 test rows grouped into pages
(quantlab/eval/lmeval.py: wikitext_documents).
"""
from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa: F401

from quantlab.eval.lmeval import DATA_DIR_KEY, local_wikitext_dataset


def load_documents(**metadata):
    """custom_dataset hook: lm-eval passes the task's metadata (TaskManager(metadata=...) merged in)."""
    return local_wikitext_dataset(metadata.get(DATA_DIR_KEY))
