"""Stop strings are matched on decoded text, across token boundaries."""

from colonnade.protocol.turns import StopMatcher


def test_stop_matcher_sees_pieces(tiny):
    _, tok = tiny
    head = tok.encode("</se", add_special_tokens=False)
    ids = head + tok.encode("arch> x", add_special_tokens=False)
    m = StopMatcher(tok, ["</search>"])
    hits = [m.hit(ids[: i + 1]) for i in range(len(ids))]
    assert True in hits and not any(hits[: len(head)])
    assert m.cut("a</search> tail</search>") == "a</search>"
