"""A generated biomedical-style corpus and factoid questions over it.

Each *cluster* is one gene and the entities around it: the protein it
encodes, a drug inhibiting that protein, the disease the drug treats and the
organism where the gene was characterized. Names are built from a small pool
of letters and syllables, so many are look-alikes (KVR12 / KVR21, velorin /
velorine), and every gene also appears in distractor documents that hold no
answer. Questions are split by cluster, so no test answer is an answer, or
even an entity, of any training question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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
FILLER = (
    "The finding was replicated in an independent cohort.",
    "Expression levels varied with age and sex.",
    "Further work is needed to establish the mechanism.",
    "Samples were collected from three clinical centres.",
    "The effect was dose dependent in cultured cells.",
)


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


def _cluster(rng: random.Random) -> Cluster:
    gene = "".join(rng.choice(GENE_LETTERS) for _ in range(3)) + str(rng.randint(1, 40))
    protein = _word(rng, 2) + rng.choice(("in", "ine", "ase"))
    stem = _word(rng, 2)
    form = rng.choice(DISEASE_FORMS)
    disease = form.format(stem)
    # "X syndrome" is also called "X disease"; other forms keep one name.
    disease_alias = f"{stem} disease" if form == "{} syndrome" else disease
    genus, species = _word(rng, 2).capitalize(), _word(rng, 2)
    return Cluster(
        gene=gene,
        protein=protein,
        # An alias unrelated to the gene's name: no shortcut from the question.
        protein_alias=f"{protein[:2].upper()}-{rng.randint(2, 99)}",
        drug=_word(rng, 2) + rng.choice(DRUG_SUFFIXES),
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
    clusters, used = [], set(exclude)
    while len(clusters) < n:
        c = _cluster(rng)
        names = cluster_names(c)
        if len(names) >= 6 and not names & used:
            used |= names
            clusters.append(c)
    return clusters


def documents(c: Cluster, rng: random.Random) -> list[str]:
    """The cluster's fact documents, then its distractors (no answer in them)."""
    f = lambda: rng.choice(FILLER)  # noqa: E731
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
class Corpus:
    docs: list[str]
    train: list[Task]
    test: list[Task]
    names: frozenset[str]  # every entity name, lowercase


def build_corpus(
    n_clusters: int = 600,
    test_fraction: float = 0.2,
    seed: int = 0,
    exclude: frozenset[str] = frozenset(),
) -> Corpus:
    """Documents (shuffled) and questions split by cluster; no name in `exclude`."""
    if n_clusters < 2 or not 0 < test_fraction < 1:
        raise ValueError("need at least 2 clusters and 0 < test_fraction < 1")
    rng = random.Random(seed + 1)
    clusters = make_clusters(n_clusters, seed, exclude)
    docs = [d for c in clusters for d in documents(c, rng)]
    rng.shuffle(docs)
    order = list(range(n_clusters))
    rng.shuffle(order)
    n_test = max(1, round(n_clusters * test_fraction))
    test_ids = set(order[:n_test])
    train = [t for i, c in enumerate(clusters) if i not in test_ids for t in questions(c, i)]
    test = [t for i, c in enumerate(clusters) if i in test_ids for t in questions(c, i)]
    names = frozenset(n for c in clusters for n in cluster_names(c))
    return Corpus(docs, train, test, names)
