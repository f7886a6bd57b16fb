"""The runtime: generate from a gdn-fx artifact with tract, numpy and tokenizers only (jinja2
for chat templates). Nothing here imports torch, transformers or torch-to-nnef, so a machine
that only runs exported files installs none of them (README, "Install").

    from gdn_fx.runtime import Generator
    gen = Generator("out/q.nnef.tgz")
    result = gen.generate([1, 2, 3], max_new_tokens=16)         # greedy token ids
    tokenizer = load_tokenizer("out/q.text")                    # copied beside the export
    text = "".join(p.text for p in gen.stream("Once", tokenizer=tokenizer))

- engine.py: tract loaded and run (the one place the runtime meets tract);
- artifact.py: what an artifact declares, and the checks before a call reaches tract;
- generator.py: :class:`Generator`, prefill and decode over one kept tract State;
- sampling.py, text.py, streaming.py: token choice, tokenizers and chat, streamed text;
- parallel.py: several sequences at once, one State per thread;
- batch.py: :class:`BatchGenerator`, B sequences in one call of a batched artifact.
"""

from gdn_fx.runtime.artifact import UnverifiedPair, load_graph
from gdn_fx.runtime.batch import BatchGenerator
from gdn_fx.runtime.generator import GenerationResult, Generator
from gdn_fx.runtime.text import load_tokenizer

__all__ = ["BatchGenerator", "GenerationResult", "Generator", "UnverifiedPair", "load_graph", "load_tokenizer"]
