from colonnade.model.tokenizer import train_bpe_tokenizer

# One name seen 3 times among words seen 100 times: the shape of searchqa's
# text, where every entity name occurs in a handful of documents.
TEXTS = ["the gene encodes a protein"] * 100 + ["the gene zorvexil"] * 3


def _pieces(tok, text: str) -> list[str]:
    return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))


def test_without_a_floor_a_rare_name_becomes_a_token_of_its_own():
    tok = train_bpe_tokenizer(TEXTS, vocab_size=400)
    assert _pieces(tok, " zorvexil") == ["Ġzorvexil"]


def test_the_floor_spells_rare_names_in_shared_pieces_and_keeps_common_words():
    tok = train_bpe_tokenizer(TEXTS, vocab_size=400, min_frequency=10)
    assert len(_pieces(tok, " zorvexil")) == len(b" zorvexil")  # bytes only
    assert _pieces(tok, " protein") == ["Ġprotein"]
    assert tok.decode(tok.encode(" zorvexil", add_special_tokens=False)) == " zorvexil"
