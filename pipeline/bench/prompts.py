"""Built-in benchmark prompt sets, made locally and deterministically (no downloads).

  code   the start of functions from the held-out Python stdlib files (files no pair model trained on, when the
         pair was made by pipeline/tinymodels.py or pipeline/trained_pair.py with the same seed)
  json   generated JSON records, cut inside a record, so the continuation is predictable structure
  prose  short English paragraphs written for this benchmark, cut after their opening sentence
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

PROMPT_SETS = ("code", "json", "prose")

_DEF_LINE = re.compile(r"^\s*def \w+\(.*\).*:\s*$")

PROSE = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a small tin of oil, a rag "
    "and a notebook in which he wrote down the weather, the ships he had seen and anything else that seemed worth "
    "remembering.",
    "Bread is one of the oldest prepared foods. The first loaves were probably flat and baked on hot stones, and "
    "it took thousands of years before bakers learned to keep a little dough from one batch to raise the next.",
    "When the river froze that winter, the children of the village skated from one bank to the other for the "
    "first time in living memory. Their grandparents stood at the edge and warned them about the thin ice near "
    "the mill.",
    "A good map leaves things out. It shows the roads a traveller needs and hides the thousand details that would "
    "only get in the way, which is why a map of the underground looks nothing like the streets above it.",
    "The committee met on the first Tuesday of every month in the back room of the library. Most meetings were "
    "short, but the one about the new car park lasted until the caretaker turned off the lights.",
    "Bees find their way home by the position of the sun. On cloudy days they use the pattern of polarized light "
    "in the sky, and when a forager returns she dances to tell the others where the flowers are.",
    "The old train station had been closed for twenty years when a group of volunteers decided to restore it. "
    "They started with the clock above the entrance, which had stopped at a quarter past four.",
    "Learning a musical instrument as an adult is different from learning it as a child. Adults understand the "
    "theory faster, but their fingers are slower to follow, and they are far more afraid of sounding bad.",
    "The storm arrived earlier than the forecast had promised. By noon the harbour was empty, the fishing boats "
    "were tied twice over, and the café on the corner had pulled its chairs inside.",
    "Every spring the gardeners argue about when to plant the tomatoes. Some trust the calendar, some trust the "
    "soil, and one old man swears by the day the swallows come back to the barn.",
    "A library card was the most valuable thing she owned. With it she read about volcanoes, ancient Egypt, the "
    "lives of painters and how to build a radio from parts found in a drawer.",
    "The expedition reached the pass two days late. The mules were tired, the cook had run out of coffee, and "
    "the surveyor found that his best instrument had been cracked somewhere on the trail.",
]

_NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Julia", "Kofi", "Lena"]
_SURNAMES = ["Smith", "Garcia", "Nowak", "Okafor", "Tanaka", "Muller", "Rossi", "Singh", "Haddad", "Larsen"]
_CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Lima", "Dublin", "Austin", "Seoul", "Perth"]
_TAGS = ["admin", "beta", "billing", "support", "trial", "vip", "ops", "research"]


def code_prompts(n: int, seed: int = 0, max_chars: int = 400, pair_seed: int = 0) -> list[str]:
    """Up to ``n`` prompts, each ending with a ``def`` line from a different held-out stdlib file.

    ``pair_seed`` must be the seed the pair was made with: it decides which files were held out.
    """
    from ..tinymodels import split_files, stdlib_files

    _, held_out = split_files(stdlib_files(), pair_seed)
    rng = random.Random(seed)
    files = list(held_out)
    rng.shuffle(files)
    prompts: list[str] = []
    for path in files:
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        defs = [i for i, line in enumerate(lines) if _DEF_LINE.match(line) and i > 0]
        if not defs:
            continue
        end = rng.choice(defs)
        # Walk back whole lines while they fit, so the prompt starts at a line boundary.
        start, size = end, len(lines[end])
        while start > 0 and size + len(lines[start - 1]) <= max_chars:
            start -= 1
            size += len(lines[start])
        prompts.append("".join(lines[start:end + 1]))
        if len(prompts) == n:
            break
    return prompts


def _record(rng: random.Random, record_id: int) -> dict:
    first, last = rng.choice(_NAMES), rng.choice(_SURNAMES)
    return {"id": record_id, "name": f"{first} {last}", "email": f"{first.lower()}.{last.lower()}@example.com",
            "age": rng.randint(19, 79), "city": rng.choice(_CITIES),
            "tags": sorted(rng.sample(_TAGS, rng.randint(1, 3))), "active": rng.random() < 0.7,
            "score": round(rng.uniform(0, 100), 1)}


def json_prompts(n: int, seed: int = 0, records: int = 2) -> list[str]:
    """``n`` prompts: a JSON list of ``records`` complete records, then the next one cut after its name key."""
    prompts = []
    for i in range(n):
        rng = random.Random(seed * 1000 + i)
        base = rng.randint(1, 900)
        body = ",\n".join("  " + json.dumps(_record(rng, base + j)) for j in range(records))
        prompts.append("[\n" + body + ',\n  {"id": ' + str(base + records) + ', "name": "')
    return prompts


def prose_prompts(n: int, seed: int = 0) -> list[str]:
    """Up to ``n`` built-in paragraphs, each cut after its first sentence."""
    order = list(range(len(PROSE)))
    random.Random(seed).shuffle(order)
    return [PROSE[i].split(". ")[0] + ". " for i in order[:n]]


def pair_seed_of(model_folder: Path) -> int:
    """The seed a locally made pair was split with (pair.json beside the model folder), else 0."""
    info = Path(model_folder).parent / "pair.json"
    if info.is_file():
        return int(json.loads(info.read_text()).get("spec", {}).get("seed", 0))
    return 0


def load_prompt_set(name: str, n: int, seed: int = 0, pair_seed: int = 0) -> list[str]:
    if name == "code":
        prompts = code_prompts(n, seed, pair_seed=pair_seed)
    elif name == "json":
        prompts = json_prompts(n, seed)
    elif name == "prose":
        prompts = prose_prompts(n, seed)
    else:
        raise ValueError(f"--prompt-set: {name!r} is not a built-in set; use one of {', '.join(PROMPT_SETS)}")
    if not prompts:
        raise ValueError(f"--prompt-set: {name!r} produced no prompts on this machine; try another set")
    return prompts
