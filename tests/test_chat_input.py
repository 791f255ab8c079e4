"""What ``ntxctl chat`` reads (``ctl/chat_input.py``): slash commands never become messages, a
mistyped one is one line naming the commands, ``//`` starts a message with ``/``, and a message
of several lines opens and closes with three double quotes."""

from __future__ import annotations

import pytest

from ntx.ctl.chat_input import COMMANDS, HELP, Turn, read_turn


def _reader(*lines: str):
    """``input`` for ``read_turn``: the lines in order, then EOFError; the prompts it was given."""
    left = list(lines)
    prompts: list[str] = []

    def read_line(prompt: str) -> str:
        prompts.append(prompt)
        if not left:
            raise EOFError
        return left.pop(0)

    return read_line, prompts


def _turns(*lines: str) -> list[Turn]:
    read_line, _ = _reader(*lines)
    out = []
    while True:
        try:
            out.append(read_turn(read_line))
        except EOFError:
            return out


def test_commands_are_never_messages():
    assert _turns("/help", " /clear ", "/exit", "/quit", "/clear now") == [
        Turn(command="/help"), Turn(command="/clear"), Turn(command="/exit"), Turn(command="/exit"),
        Turn(command="/clear")]
    (unknown,) = _turns("/nosuch please")
    assert unknown.text is None and unknown.command is None
    assert unknown.error == "unknown command /nosuch: the commands are /help, /clear, /exit (// starts a message with /)"
    assert _turns("//etc is a folder", "  ", "hello there") == [Turn(text="/etc is a folder"), Turn(text="hello there")]
    for name in COMMANDS:
        assert name in HELP
    assert '"""' in HELP and "//" in HELP


def test_a_message_of_several_lines():
    read_line, prompts = _reader('"""', "first line", "", "  indented", 'last line"""', "next")
    assert read_turn(read_line) == Turn(text="first line\n\n  indented\nlast line")
    assert prompts == ["> ", "... ", "... ", "... ", "... "]
    assert _turns('"""one line"""', '"""opened here', 'closed"""') == [Turn(text="one line"),
                                                                      Turn(text="opened here\nclosed")]
    assert _turns('""""""', "after") == [Turn(text="after")]  # an empty message is passed over


def test_the_end_of_input_ends_the_chat_inside_a_message_too():
    read_line, _ = _reader('"""', "never closed")
    with pytest.raises(EOFError):
        read_turn(read_line)
