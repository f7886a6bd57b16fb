"""Several prompts at once (gdn_fx.runtime.parallel): worker threads over one loaded artifact.

Each prompt must generate exactly what transformers' greedy ``generate`` gives for it alone
(the expected tokens come from transformers, never from gdn-fx), whatever thread served it
and whatever ran beside it.
"""

from __future__ import annotations

import pytest
import torch

from gdn_fx.cli import main
from gdn_fx.errors import UsageError
from gdn_fx.hf.configs import SAFE_TOKEN_RANGE
from gdn_fx.hf.generator import Generator, check_generation
from gdn_fx.runtime.parallel import generate_all, serve, stream_all

pytestmark = pytest.mark.slow  # whole-model exports (make test-fast skips them)

LENGTHS = (1, 5, 37, 100, 12, 64)


def _prompt(length: int, seed: int) -> list:
    low, high = SAFE_TOKEN_RANGE
    return torch.randint(low, high, (length,), generator=torch.Generator().manual_seed(seed)
                         ).tolist()


@pytest.fixture(scope="module")
def exported(shared_export):
    return shared_export("qwen3_5")  # conftest.py's, shared with test_generator.py


def test_every_prompt_generates_what_transformers_gives_it_alone(exported):
    model, files = exported
    prompts = [_prompt(length, seed) for seed, length in enumerate(LENGTHS)]
    results = generate_all(Generator(files.main, files.decode), prompts, 24, workers=3)
    assert [r.prompt for r in results] == prompts  # in the order asked
    for index, result in enumerate(results):
        found = check_generation(model, result)
        assert found.ok, f"prompt {index} ({len(prompts[index])} tokens): {found}"


def test_a_fork_shares_the_loaded_model_and_has_states_of_its_own(exported):
    _, files = exported
    generator = Generator(files.main, files.decode)
    fork = generator.fork()
    assert fork.main_graph.runnable is generator.main_graph.runnable
    assert fork.main is not generator.main and fork.decode is not generator.decode
    prompt = _prompt(20, 7)
    assert fork.generate(prompt, 12).tokens == generator.generate(prompt, 12).tokens


def test_streams_of_several_prompts_end_as_their_greedy_generation(exported):
    _, files = exported
    generator = Generator(files.main, files.decode)
    prompts = [_prompt(9, 1), _prompt(30, 2), _prompt(3, 3)]
    runs = stream_all(generator, prompts, workers=2, max_new_tokens=10)
    alone = [generator.generate(p, 10).tokens for p in prompts]
    assert [list(run.summary.tokens) for run in runs] == alone


def test_a_bad_prompt_is_refused_naming_it(exported):
    _, files = exported
    generator = Generator(files.main, files.decode)
    prompts = [_prompt(4, 1), [generator.vocab + 3], _prompt(4, 2)]
    with pytest.raises(UsageError, match=r"^prompt 1: prompt id \d+ .*outside the vocabulary"):
        generate_all(generator, prompts, 4, workers=2)


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_workers_must_be_a_positive_int(exported, workers):
    _, files = exported
    with pytest.raises(UsageError, match="workers must be an int >= 1"):
        serve(Generator(files.main), [1], lambda fork, item: item, workers)


def test_cli_generates_one_line_per_prompt_of_a_prompts_file(exported, tmp_path, capsys):
    _, files = exported
    prompts = [_prompt(6, 1), _prompt(40, 2), _prompt(2, 3)]
    listing = tmp_path / "prompts.txt"
    listing.write_text("".join(",".join(map(str, p)) + "\n" for p in prompts) + "\n")
    code = main(["generate", "--nnef", str(files.main), "--prompts-file", str(listing),
                 "--workers", "2", "--max-new-tokens", "8", "--json"])
    assert code == 0
    import json

    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    generator = Generator(files.main, files.decode)
    assert [line["tokens"] for line in lines] == [generator.generate(p, 8).tokens
                                                 for p in prompts]
