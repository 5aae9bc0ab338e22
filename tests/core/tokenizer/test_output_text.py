import pytest

from ember_core.tokenizer import OutputText, StopRules, Tokenizer
from ember_core.tokenizer.stop_strings import StopMatch, StopStringMatcher
from tests.gateway.fake_engine import byte_tokenizer_spec


def feed(stops: list[str], pieces: list[str], include_stop: bool = False) -> tuple[list[str], bool, str]:
    """Per-push output, whether a stop hit, and the text held at the end (flushed)."""
    matcher = StopStringMatcher(stops, include_stop)
    outputs = []
    for piece in pieces:
        match = matcher.push(piece)
        outputs.append(match.text)
        if match.stopped:
            return outputs, True, ""
    return outputs, False, matcher.flush()


def test_no_stop_strings_passes_text_through():
    assert feed([], ["ab", "c"]) == (["ab", "c"], False, "")


def test_stop_inside_one_piece_cuts_before_it():
    assert feed(["STOP"], ["abcSTOPdef"]) == (["abc"], True, "")


def test_an_included_stop_string_ends_the_text():
    assert feed(["STOP"], ["abcSTOPdef"], include_stop=True) == (["abcSTOP"], True, "")
    assert feed(["STOP", "cS"], ["ab", "cST", "OP"], include_stop=True) == (["ab", "cS"], True, "")


def test_stop_across_pieces_and_hold_back():
    outputs, stopped, _ = feed(["STOP"], ["abc S", "T", "O", "Pxyz"])
    assert outputs == ["abc ", "", "", ""]
    assert stopped


def test_hold_back_only_the_longest_suffix_that_can_start_a_stop():
    matcher = StopStringMatcher(["abcd"])
    assert matcher.push("xxab") == StopMatch("xx", False)  # "ab" may become "abcd"
    assert matcher.push("x") == StopMatch("abx", False)  # it did not
    assert matcher.push("aba") == StopMatch("ab", False)  # only the last "a" can still start it


def test_false_start_is_released_when_text_ends():
    assert feed(["STOP"], ["abc ST"]) == (["abc "], False, "ST")


def test_stop_at_the_very_start():
    assert feed(["<"], ["<tag>"]) == ([""], True, "")
    assert feed(["ab"], ["a", "b", "c"]) == (["", ""], True, "")


def test_multiple_stops_the_one_completing_first_wins():
    # "bc" completes before "abcd" does, whichever way the text is split.
    assert feed(["abcd", "bc"], ["abcd"]) == (["a"], True, "")
    assert feed(["abcd", "bc"], ["a", "b", "c", "d"]) == (["", "", "a"], True, "")
    # Same end: the longer (earlier-starting) one wins.
    assert feed(["c", "bc"], ["abc"]) == (["a"], True, "")


def test_multiple_stops_hold_back_for_any_of_them():
    matcher = StopStringMatcher(["xyz", "hello"])
    assert matcher.push("say hel") == StopMatch("say ", False)
    assert matcher.push("p x") == StopMatch("help ", False)
    assert matcher.push("yz!") == StopMatch("", True)


@pytest.mark.parametrize("text", ["one two three", "aaa stop bbb", "stostop", "sto", "ünï €stop"])
def test_any_split_gives_the_same_result_as_one_push(text: str):
    stops = ["stop", "two t"]
    whole_outputs, whole_stopped, whole_rest = feed(stops, [text])
    for split in range(len(text) + 1):
        outputs, stopped, rest = feed(stops, [text[:split], text[split:]])
        assert ("".join(outputs) + rest, stopped) == ("".join(whole_outputs) + whole_rest, whole_stopped)


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_output_text_matches_stops_across_tokens_and_never_splits_characters():
    tokenizer = Tokenizer.from_spec(byte_tokenizer_spec())
    ids = tokenizer.encode("€uro STOP after")  # one token per byte: "€" is three tokens
    text = OutputText(tokenizer, StopRules(("STOP",)))
    outputs = []
    for token_id in ids:
        outputs.append(text.push([token_id], final=False))
        if outputs[-1].stopped:
            break
    sent = [match.text for match in outputs]
    assert "".join(sent) == "€uro "
    assert sent[:3] == ["", "", "€"]
    assert len(outputs) == len(tokenizer.encode("€uro STOP"))


def test_output_text_flushes_held_text_on_the_last_tokens():
    tokenizer = Tokenizer.from_spec(byte_tokenizer_spec())
    text = OutputText(tokenizer, StopRules(("STOP",)))
    assert text.push(tokenizer.encode("end ST"), final=False).text == "end "
    assert text.push(tokenizer.encode("O"), final=True) == StopMatch("STO", False)


def test_output_text_skips_ids_without_text():
    tokenizer = Tokenizer.from_spec(byte_tokenizer_spec())
    text = OutputText(tokenizer)
    eos = tokenizer.eos_token_id
    assert text.push([*tokenizer.encode("ok"), 299, eos], final=True).text == "ok"


def push_one_by_one(text: OutputText, ids: list[int], stop_token: bool = False) -> tuple[str, int]:
    """The text sent and the tokens pushed until a stop string hit or the ids ran out."""
    sent = []
    for i, token_id in enumerate(ids):
        final = i == len(ids) - 1
        match = text.push([token_id], final, stop_token and final)
        sent.append(match.text)
        if match.stopped:
            break
    return "".join(sent), i + 1


def test_stop_strings_end_an_output_only_from_min_tokens_on():
    tokenizer = Tokenizer.from_spec(byte_tokenizer_spec())
    ids = tokenizer.encode("a.b.c.d.e")
    assert push_one_by_one(OutputText(tokenizer, StopRules((".",))), ids) == ("a", 2)
    # The "." of tokens 2 and 4 come before the 5th token; the one of token 6 stops the output.
    assert push_one_by_one(OutputText(tokenizer, StopRules((".",), min_tokens=5)), ids) == ("a.b.c", 6)
    assert push_one_by_one(OutputText(tokenizer, StopRules((".",), min_tokens=6)), ids) == ("a.b.c", 6)


def test_the_stop_token_that_ended_an_output_gives_no_text_unless_included():
    tokenizer = Tokenizer.from_spec(byte_tokenizer_spec())
    ids = tokenizer.encode("Paris.")  # "." as a stop token id
    assert push_one_by_one(OutputText(tokenizer), ids, stop_token=True) == ("Paris", 6)
    assert push_one_by_one(OutputText(tokenizer, StopRules(include_in_output=True)), ids, stop_token=True) == ("Paris.", 6)
    assert push_one_by_one(OutputText(tokenizer), ids) == ("Paris.", 6)  # "." ended by max_tokens


def test_a_character_cut_off_at_the_end_gives_no_replacement_character():
    tokenizer = Tokenizer.from_spec(byte_tokenizer_spec())
    ids = tokenizer.encode("ok €")[:-1]  # the last of the euro sign's three bytes never came
    assert push_one_by_one(OutputText(tokenizer), ids) == ("ok ", len(ids))
