"""A generated biomedical-style corpus and factoid questions over it.

Each *cluster* is one gene and the entities around it: the protein it
encodes, a drug inhibiting that protein, the disease the drug treats and the
organism where the gene was characterized. Names are built from a small pool
of letters and syllables, so many are look-alikes (KVR12 / KVR21, velorin /
velorine), and every gene also appears in distractor documents that hold no
answer. Questions are split by cluster, so no test answer is an answer, or
even an entity, of any training question.

With `hops=2` every question goes through a bridge entity ("Which disease is
treated with the drug that inhibits velorin?": velorin -> its drug -> the
disease). Facts only link neighbours in the chain gene - protein - drug -
disease, so no document names both the question's entity and its answer: the
first search can only reveal the bridge. Each cluster also gets decoy
documents that put the question's entity next to a look-alike of the answer
(kavenib for kavemab), so answering from the first search is confidently
wrong. Decoys are never an answer.

Names are two syllables long (genes three letters and a number up to 40)
up to `SMALL_NAMES` clusters; a larger corpus has four-syllable names
(genes four letters and a number up to 99), else it would run out of
distinct names near 2,500 clusters. Without documents (`docs=False`: an
environment whose corpus is behind a tool service), the tasks and their
split are those of the corpus with documents: the same draws are taken.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..base import Task

SYLLABLES = [
    "ka",
    "ve",
    "lo",
    "ri",
    "ta",
    "mon",
    "sel",
    "dra",
    "fi",
    "nu",
    "zor",
    "pel",
    "qua",
    "tri",
    "bex",
    "gal",
    "hu",
    "ix",
    "jor",
    "lum",
    "sar",
    "ten",
    "vo",
    "cri",
    "mek",
    "ost",
    "pha",
    "rud",
    "sy",
]
GENE_LETTERS = "BCDKLMRSTVX"
TISSUES = ("liver", "kidney", "retina", "spleen", "lung", "heart", "skin", "pancreas", "thymus")
DRUG_SUFFIXES = ("mab", "nib", "zole", "pril", "statin", "cillin")
DISEASE_FORMS = ("{}osis", "{}itis", "{} syndrome", "{} fever")
PROTEIN_ENDINGS = ("in", "ine", "ase")
HOPS = (1, 2)
SMALL_NAMES = 1000  # clusters, at most, with two-syllable names (as this corpus always had)
# Draws of a fresh decoy name before giving up: the name space is finite
# (2,523 proteins), and a corpus near its size would otherwise never finish.
DECOY_DRAWS = 10_000
FILLER = (
    "The finding was replicated in an independent cohort.",
    "Expression levels varied with age and sex.",
    "Further work is needed to establish the mechanism.",
    "Samples were collected from three clinical centres.",
    "The effect was dose dependent in cultured cells.",
)


@dataclass(frozen=True)
class Names:
    """How long a corpus's names are."""

    syllables: int  # of a protein, drug or disease stem, and of each organism word
    gene_letters: int
    gene_numbers: int  # genes are numbered 1 to this
    alias_letters: int  # of the protein's name, in its alias (VE-12 for velorin)
    alias_numbers: int  # aliases are numbered 2 to this


SMALL = Names(syllables=2, gene_letters=3, gene_numbers=40, alias_letters=2, alias_numbers=99)
LARGE = Names(syllables=4, gene_letters=4, gene_numbers=99, alias_letters=3, alias_numbers=999)


def names_for(n_clusters: int) -> Names:
    return SMALL if n_clusters <= SMALL_NAMES else LARGE


@dataclass(frozen=True)
class Cluster:
    gene: str
    protein: str
    protein_alias: str
    drug: str
    disease: str
    disease_alias: str
    organism: str
    tissue: str


def _word(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(n))


def _gene(rng: random.Random, n: Names) -> str:
    letters = "".join(rng.choice(GENE_LETTERS) for _ in range(n.gene_letters))
    return letters + str(rng.randint(1, n.gene_numbers))


def _cluster(rng: random.Random, n: Names = SMALL) -> Cluster:
    gene = _gene(rng, n)
    protein = _word(rng, n.syllables) + rng.choice(PROTEIN_ENDINGS)
    stem = _word(rng, n.syllables)
    form = rng.choice(DISEASE_FORMS)
    disease = form.format(stem)
    # "X syndrome" is also called "X disease"; other forms keep one name.
    disease_alias = f"{stem} disease" if form == "{} syndrome" else disease
    genus, species = _word(rng, n.syllables).capitalize(), _word(rng, n.syllables)
    return Cluster(
        gene=gene,
        protein=protein,
        # An alias unrelated to the gene's name: no shortcut from the question.
        protein_alias=f"{protein[: n.alias_letters].upper()}-{rng.randint(2, n.alias_numbers)}",
        drug=_word(rng, n.syllables) + rng.choice(DRUG_SUFFIXES),
        disease=disease,
        disease_alias=disease_alias,
        organism=f"{genus}{rng.choice(('us', 'a'))} {species}{rng.choice(('is', 'ae'))}",
        tissue=rng.choice(TISSUES),
    )


def cluster_names(c: Cluster) -> set[str]:
    names = {c.gene.lower(), c.protein, c.protein_alias.lower(), c.drug, c.disease}
    return names | {c.organism.lower(), c.disease_alias}


def make_clusters(n: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[Cluster]:
    """n clusters whose entity names are all distinct (across clusters too) and
    none of them in `exclude`."""
    rng = random.Random(seed)
    clusters, used, size = [], set(exclude), names_for(n)
    while len(clusters) < n:
        c = _cluster(rng, size)
        names = cluster_names(c)
        if len(names) >= 6 and not names & used:
            used |= names
            clusters.append(c)
    return clusters


FACTS = 6  # documents a cluster has, each with a filler sentence drawn in order


def fillers(rng: random.Random) -> list[str]:
    """The filler sentences of one cluster's documents: the draws `documents` takes."""
    return [rng.choice(FILLER) for _ in range(FACTS)]


def documents(c: Cluster, rng: random.Random) -> list[str]:
    """The cluster's fact documents, then its distractors (no answer in them)."""
    f = iter(fillers(rng)).__next__
    return [
        f"The {c.organism} gene {c.gene} encodes {c.protein} (also called {c.protein_alias}), "
        f"a protein found mainly in the {c.tissue}. {f()}",
        f"{c.protein.capitalize()} activity is inhibited by {c.drug}, a small molecule. {f()}",
        f"{c.drug.capitalize()} is used to treat {c.disease} in adult patients. {f()}",
        f"The gene {c.gene} was first characterized in {c.organism}. {f()}",
        f"{c.gene} expression was measured in {c.tissue} samples of a cohort study. {f()}",
        f"A screen of {c.tissue} tissue found no change in {c.gene} after treatment. {f()}",
    ]


def questions(c: Cluster, index: int) -> list[Task]:
    """The cluster's four questions; `subject` in their info is the entity each names."""
    info = {"cluster": str(index), "gene": c.gene}
    return [
        Task(
            f"q{index}-protein",
            f"Which protein is encoded by the gene {c.gene}?",
            (c.protein, c.protein_alias),
            {**info, "relation": "encodes", "subject": c.gene},
        ),
        Task(
            f"q{index}-drug",
            f"Which drug inhibits {c.protein}?",
            (c.drug,),
            {**info, "relation": "inhibited_by", "subject": c.protein},
        ),
        Task(
            f"q{index}-disease",
            f"Which disease is treated with {c.drug}?",
            tuple(dict.fromkeys((c.disease, c.disease_alias))),
            {**info, "relation": "treats", "subject": c.drug},
        ),
        Task(
            f"q{index}-organism",
            f"In which organism was the gene {c.gene} first characterized?",
            (c.organism,),
            {**info, "relation": "characterized_in", "subject": c.gene},
        ),
    ]


@dataclass(frozen=True)
class Decoys:
    """A cluster's look-alike names for multi-hop decoys; none is any task's answer."""

    gene: str
    protein: str
    drug: str
    disease: str

    def names(self) -> set[str]:
        return {self.gene.lower(), self.protein, self.drug, self.disease}


def _swap_ending(name: str, endings: Sequence[str], rng: random.Random) -> str:
    """`name` with its ending replaced by another of `endings` (kavemab -> kavenib)."""
    ending = next(e for e in endings if name.endswith(e))
    return name[: len(name) - len(ending)] + rng.choice([e for e in endings if e != ending])


def _decoy_candidates(c: Cluster, rng: random.Random, n: Names) -> Decoys:
    """Look-alikes first; the gene's letters rotated (KVR12 -> VRK12)."""
    letters, number = c.gene[: n.gene_letters], c.gene[n.gene_letters :]
    forms = [f.format("") for f in DISEASE_FORMS]
    stem = c.disease.removesuffix(next(f for f in forms if c.disease.endswith(f)))
    return Decoys(
        gene=letters[1:] + letters[0] + number,
        protein=_swap_ending(c.protein, PROTEIN_ENDINGS, rng),
        drug=_swap_ending(c.drug, DRUG_SUFFIXES, rng),
        # One word (velosis for velo fever): a decoy sharing the word "velo"
        # with the disease would be found by a search for the disease, and
        # its document names the protein that answers that question.
        disease=stem + rng.choice([f for f in ("osis", "itis") if not c.disease.endswith(f)]),
    )


def _fresh(kind: str, rng: random.Random, n: Names) -> str:
    """A new name of `kind`'s shape, for when the look-alike is taken."""
    if kind == "gene":
        return _gene(rng, n)
    if kind == "protein":
        return _word(rng, n.syllables) + rng.choice(PROTEIN_ENDINGS)
    if kind == "drug":
        return _word(rng, n.syllables) + rng.choice(DRUG_SUFFIXES)
    return rng.choice(DISEASE_FORMS).format(_word(rng, n.syllables))


def make_decoys(clusters: Sequence[Cluster], seed: int, taken: frozenset[str]) -> list[Decoys]:
    """One set of decoys per cluster, no name among `taken` (lowercase) or another decoy.

    Equal names are what must never meet: a decoy equal to some task's answer
    would make the decoy document an answer document.
    """
    rng = random.Random(f"searchqa-decoys-{seed}")
    used, out, size = set(taken), [], names_for(len(clusters))
    for c in clusters:
        picked = {}
        for kind, name in vars(_decoy_candidates(c, rng, size)).items():
            for _ in range(DECOY_DRAWS):
                if name.lower() not in used:
                    break
                name = _fresh(kind, rng, size)
            else:
                raise ValueError(f"no free {kind} name for a decoy: use fewer clusters")
            used.add(name.lower())
            picked[kind] = name
        out.append(Decoys(**picked))
    return out


def decoy_documents(c: Cluster, d: Decoys, rng: random.Random) -> list[str]:
    """Documents that name each multi-hop question's entity beside a look-alike of
    its answer, in the question's own words, so the first search ranks them high."""
    f = lambda: rng.choice(FILLER)  # noqa: E731
    return [
        f"The drug {d.drug} left the protein of the gene {c.gene} unchanged. {f()}",
        f"{c.protein.capitalize()} levels were normal in the disease {d.disease}, "
        f"and no drug changed them. {f()}",
        f"{c.drug.capitalize()} did not change the expression of the gene {d.gene}. {f()}",
        f"In {c.disease}, the protein {d.protein} was not inhibited by any drug. {f()}",
    ]


def multihop_questions(c: Cluster, d: Decoys, index: int) -> list[Task]:
    """The cluster's four two-hop questions.

    info: `subject` (the entity the question names), `bridge` (the entity the
    first search reveals), `then` (the question to ask about the bridge,
    less the bridge: `f"{then} {bridge}?"`) and `decoy` (the look-alike).
    Each question opens with its `then`, so the second query is a copy.
    """
    info = {"cluster": str(index), "gene": c.gene}
    # The first search must rank the bridge's document in the top k: the
    # questions use its words ("encodes" rather than "encoded": no stemming).
    rows = [
        ("drug", "Which drug inhibits", f"the protein that the gene {c.gene} encodes", c.gene,
         c.protein, (c.drug,), d.drug),
        ("disease", "Which disease is treated with", f"the drug that inhibits {c.protein}",
         c.protein, c.drug, (c.disease, c.disease_alias), d.disease),
        ("gene", "Which gene encodes", f"the protein inhibited by {c.drug}", c.drug, c.protein,
         (c.gene,), d.gene),
        ("protein", "Which protein is inhibited by", f"the drug used to treat {c.disease}",
         c.disease, c.drug, (c.protein, c.protein_alias), d.protein),
    ]  # fmt: skip
    return [
        Task(
            f"q{index}-{kind}2",
            f"{then} {path}?",
            tuple(dict.fromkeys(answers)),
            {
                **info,
                "relation": f"{kind}2",
                "subject": subject,
                "bridge": bridge,
                "then": then,
                "decoy": decoy,
            },
        )
        for kind, then, path, subject, bridge, answers, decoy in rows
    ]


def find_name(text: str, name: str) -> str | None:
    """`name` as `text` spells it, where it occurs as whole words (KVR1 is not
    in KVR12, velorin not in velorine), ignoring case; None if it does not."""
    found = re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text, flags=re.IGNORECASE)
    return found[0] if found else None


@dataclass(frozen=True)
class Corpus:
    docs: list[str]  # [] where the documents are a tool service's (`docs=False`)
    train: list[Task]
    test: list[Task]
    names: frozenset[str] = field(repr=False)  # every entity name, lowercase


def build_corpus(
    n_clusters: int = 600,
    test_fraction: float = 0.2,
    seed: int = 0,
    exclude: frozenset[str] = frozenset(),
    hops: int = 1,
    docs: bool = True,
) -> Corpus:
    """Documents (shuffled) and questions split by cluster; no name in `exclude`.

    `hops=2`: the two-hop questions, over the same fact documents plus decoys.
    `docs=False`: the same questions and split, no documents.
    """
    if n_clusters < 2 or not 0 < test_fraction < 1:
        raise ValueError("need at least 2 clusters and 0 < test_fraction < 1")
    if hops not in HOPS:
        raise ValueError(f"hops must be one of {HOPS}, not {hops!r}")
    rng = random.Random(seed + 1)
    clusters = make_clusters(n_clusters, seed, exclude)
    # Without documents, their draws are taken all the same: the split below
    # comes from the same generator.
    texts = [d for c in clusters for d in (documents(c, rng) if docs else fillers(rng))]
    names = frozenset(n for c in clusters for n in cluster_names(c))
    ask = questions
    if hops == 2:
        decoys = make_decoys(clusters, seed, names | exclude)
        drng = random.Random(f"searchqa-decoy-docs-{seed}")
        texts += [
            x for c, d in zip(clusters, decoys, strict=True) for x in decoy_documents(c, d, drng)
        ]
        names = names.union(*(d.names() for d in decoys))
        ask = lambda c, i: multihop_questions(c, decoys[i], i)  # noqa: E731
    rng.shuffle(texts)
    order = list(range(n_clusters))
    rng.shuffle(order)
    n_test = max(1, round(n_clusters * test_fraction))
    test_ids = set(order[:n_test])
    train = [t for i, c in enumerate(clusters) if i not in test_ids for t in ask(c, i)]
    test = [t for i, c in enumerate(clusters) if i in test_ids for t in ask(c, i)]
    return Corpus(texts if docs else [], train, test, names)
