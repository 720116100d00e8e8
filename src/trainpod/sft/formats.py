"""Dataset rows -> samples: an optional system prompt and (user, assistant) pairs, or a plain text.

The formats are LLaMA-Factory's: alpaca (instruction + input -> output, optional system and history
of [instruction, answer] pairs), sharegpt (a list of {from, value} turns), and OpenAI-style messages
({role, content}); plus text, a document trained on every token. Preference rows (sft.preference) hold a
prompt and two answers to it, chosen and rejected, as LLaMA-Factory's ranking datasets and TRL's preference
datasets do: RowReader.pair makes them two samples that differ in their last answer alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainpod.config.sft import SftSourceConfig
from trainpod.errors import InputError
from trainpod.sft.sources import Row


@dataclass(frozen=True)
class Sample:
    system: str | None
    pairs: tuple[tuple[str, str], ...]  # (user message, assistant answer), in order
    text: str | None = None  # the text format: no template, every token trained

    def messages(self) -> list[dict[str, str]]:
        """OpenAI-style messages, what `apply_chat_template` takes."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for user, assistant in self.pairs:
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return out


class RowReader:
    """Turns the rows of one dataset (entry `index` of `section`.datasets: sft, a finetune's data.sft) into samples."""

    def __init__(self, source: SftSourceConfig, index: int, section: str = "sft"):
        self.source = source
        self.field_prefix = f"{section}.datasets[{index}]"

    def sample(self, row: Row) -> Sample:
        if self.source.format == "text":
            return Sample(None, (), self._string(row, "text", required=True))
        if self.source.format == "alpaca":
            return self._alpaca(row)
        return self._conversation(row)

    def _column_value(self, row: Row, key: str, required: bool) -> object:
        column = self.source.column(key)
        if column not in row.record:
            if not required:
                return None
            raise InputError(
                f"{row.where}: dataset {self.source.path!r} ({self.source.format} format) has no column "
                f"{column!r}; the row's columns are: {', '.join(sorted(map(str, row.record))) or '(none)'}. "
                f"Map it with {self.field_prefix}.columns.{key}: <column name>, or fix the data"
            )
        return row.record[column]

    def _string(self, row: Row, key: str, required: bool) -> str | None:
        value = self._column_value(row, key, required)
        if value is None and not required:
            return None
        if not isinstance(value, str):
            raise self._bad(row, self.source.column(key), value, "a string")
        return value

    def _bad(self, row: Row, field: str, value: object, expected: str) -> InputError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        return InputError(
            f"{row.where}: field {field!r} = {shown} is not {expected}; fix the row "
            f"(or the column mapping {self.field_prefix}.columns)"
        )

    def _alpaca(self, row: Row) -> Sample:
        system, history, user = self._alpaca_prompt(row)
        answer = self._string(row, "response", required=True)
        return Sample(system, (*history, (user, answer)))

    def _alpaca_prompt(self, row: Row) -> tuple[str | None, tuple[tuple[str, str], ...], str]:
        """An alpaca row's system prompt, earlier turns and last instruction (joined with its input)."""
        instruction = self._string(row, "prompt", required=True)
        query = self._string(row, "query", required=False)
        system = self._string(row, "system", required=False)
        history = self._column_value(row, "history", required=False) or []
        pairs = []
        if not isinstance(history, list):
            raise self._bad(
                row, self.source.column("history"), history, "a list of [instruction, answer] pairs"
            )
        for turn in history:
            if not (
                isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(t, str) for t in turn)
            ):
                raise self._bad(
                    row, self.source.column("history"), turn, "an [instruction, answer] pair of strings"
                )
            pairs.append((turn[0], turn[1]))
        user = "\n".join(part for part in (instruction, query) if part)  # LLaMA-Factory joins them so
        return system or None, tuple(pairs), user

    def _conversation(self, row: Row) -> Sample:
        system, turns = self._turns(row)
        return Sample(system, self._pairs(row, self.source.column("messages"), turns))

    def _turns(self, row: Row) -> tuple[str | None, list[tuple[str, str]]]:
        """A conversation row's system prompt (its column, or a first system turn) and its other turns."""
        turns = self._column_value(row, "messages", required=True)
        column = self.source.column("messages")
        if not isinstance(turns, list) or not turns:
            raise self._bad(row, column, turns, "a non-empty list of turns")
        system = self._string(row, "system", required=False)
        parsed: list[tuple[str, str]] = []
        for number, turn in enumerate(turns):
            role, content = self._turn(row, f"{column}[{number}]", turn)
            if role == "system" and number == 0:
                system = content
                continue
            parsed.append((role, content))
        return system or None, parsed

    def _turn(self, row: Row, where: str, turn: object) -> tuple[str, str]:
        """One {role, content} turn -> (user/assistant/system, its text)."""
        role_tag, content_tag = self.source.column("role_tag"), self.source.column("content_tag")
        roles = {
            self.source.column("user_tag"): "user",
            self.source.column("assistant_tag"): "assistant",
            self.source.column("system_tag"): "system",
        }
        if not isinstance(turn, dict) or role_tag not in turn or content_tag not in turn:
            raise self._bad(row, where, turn, f"an object with {role_tag!r} and {content_tag!r}")
        role = roles.get(turn[role_tag])
        if role is None:
            raise self._bad(
                row, f"{where}.{role_tag}", turn[role_tag], f"one of {', '.join(map(repr, roles))}"
            )
        if not isinstance(turn[content_tag], str):
            raise self._bad(row, f"{where}.{content_tag}", turn[content_tag], "a string")
        return role, turn[content_tag]

    def _pairs(self, row: Row, column: str, turns: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
        """user, assistant, user, assistant, ...: the order every chat template assumes."""
        expected = ["user", "assistant"] * (len(turns) // 2)
        if not turns or [role for role, _ in turns] != expected or len(turns) % 2:
            order = ", ".join(role for role, _ in turns) or "(none)"
            raise InputError(
                f"{row.where}: field {column!r} has turns in the order {order}; a sample needs user and "
                "assistant turns alternating, starting with user and ending with assistant (one system turn "
                "may come first); fix the row or its role tags"
            )
        return tuple((turns[i][1], turns[i + 1][1]) for i in range(0, len(turns), 2))

    # Preference data (sft.preference): a prompt and two answers to it, as LLaMA-Factory's ranking datasets
    # and TRL's preference datasets hold them.

    def pair(self, row: Row) -> tuple[Sample, Sample]:
        """A preference row -> (chosen, rejected): two samples with the same system prompt and turns, each
        ending with its own answer to the row's last user message."""
        if self.source.format == "alpaca":
            system, history, user = self._alpaca_prompt(row)
            chosen, rejected = self._answer(row, "chosen"), self._answer(row, "rejected")
        elif self._whole_conversations(row):
            system, history, user, chosen, rejected = self._shared_prompt(row)
        else:
            system, turns = self._turns(row)
            history, user = self._prompt_turns(row, self.source.column("messages"), turns)
            chosen, rejected = self._answer(row, "chosen"), self._answer(row, "rejected")
        if chosen == rejected:
            shown = repr(chosen) if len(repr(chosen)) <= 60 else repr(chosen)[:57] + "..."
            raise InputError(
                f"{row.where}: fields {self.source.column('chosen')!r} and {self.source.column('rejected')!r} "
                f"hold the same answer {shown}, a pair that teaches nothing; fix the row or remove it"
            )
        return Sample(system, (*history, (user, chosen))), Sample(system, (*history, (user, rejected)))

    def _whole_conversations(self, row: Row) -> bool:
        """Whether the row's chosen and rejected are whole conversations, the prompt's turns included (TRL's
        implicit prompt: trl-lib/ultrafeedback_binarized, HuggingFaceH4/ultrafeedback_binarized), not answers."""
        return all(
            isinstance(value := row.record.get(self.source.column(key)), list) and len(value) > 1
            for key in ("chosen", "rejected")
        )

    def _shared_prompt(self, row: Row) -> tuple[str | None, tuple[tuple[str, str], ...], str, str, str]:
        """(system, history, last user message, chosen answer, rejected answer) of a row whose chosen and rejected
        are whole conversations: the prompt is the turns the two share, each answer its own last assistant turn,
        as TRL's extract_prompt splits them. The row's messages column is not read (HuggingFaceH4's
        ultrafeedback_binarized holds the chosen conversation there again, and its prompt as a string)."""
        conversations = {}
        for key in ("chosen", "rejected"):
            column = self.source.column(key)
            turns = row.record[column]
            conversations[key] = [self._turn(row, f"{column}[{n}]", turn) for n, turn in enumerate(turns)]
        chosen, rejected = conversations["chosen"], conversations["rejected"]
        names = f"{self.source.column('chosen')!r} and {self.source.column('rejected')!r}"
        if chosen[:-1] != rejected[:-1]:
            turn = next(
                (n for n, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1], strict=False)) if a != b),
                min(len(chosen), len(rejected)) - 1,
            )
            raise InputError(
                f"{row.where}: fields {names} hold whole conversations that differ before their last turn (at "
                f"turn {turn}); a preference pair is one prompt and two answers to it: give the same turns up to "
                "the user's last, then one assistant answer each, or put the prompt in its own column "
                f"({self.field_prefix}.columns.messages) and one answer in each"
            )
        for key, turns in conversations.items():
            if turns[-1][0] != "assistant":
                column, role_tag = self.source.column(key), self.source.column("role_tag")
                last = f"{column}[{len(turns) - 1}].{role_tag}"
                raise self._bad(
                    row, last, turns[-1][0], f"{self.source.column('assistant_tag')!r} (the answer)"
                )
        system = self._string(row, "system", required=False)
        prompt = chosen[:-1]
        if prompt[0][0] == "system":
            system, prompt = prompt[0][1], prompt[1:]
        history, user = self._prompt_turns(row, self.source.column("chosen"), prompt)
        return system or None, history, user, chosen[-1][1], rejected[-1][1]

    def _prompt_turns(
        self, row: Row, column: str, turns: list[tuple[str, str]]
    ) -> tuple[tuple[tuple[str, str], ...], str]:
        """user, assistant, ..., user: a preference row's turns, the answers to the last in chosen and rejected."""
        expected = ["user", "assistant"] * (len(turns) // 2) + ["user"]
        if [role for role, _ in turns] != expected:
            order = ", ".join(role for role, _ in turns) or "(none)"
            raise InputError(
                f"{row.where}: field {column!r} has turns in the order {order}; a preference row needs user "
                "and assistant turns alternating, starting and ending with user (one system turn may come "
                f"first): the answers to the last are {self.source.column('chosen')!r} and "
                f"{self.source.column('rejected')!r}; fix the row or its role tags"
            )
        history = tuple((turns[i][1], turns[i + 1][1]) for i in range(0, len(turns) - 1, 2))
        return history, turns[-1][1]

    def _answer(self, row: Row, key: str) -> str:
        """The chosen or rejected answer: a string; in sharegpt/messages also one assistant turn, or a list
        of one (TRL's conversational form)."""
        value = self._column_value(row, key, required=True)
        column = self.source.column(key)
        if self.source.format == "alpaca":
            if not isinstance(value, str):
                raise self._bad(row, column, value, "a string (the answer)")
            return value
        assistant = self.source.column("assistant_tag")
        expected = f"a string, one {assistant!r} turn or a list of exactly one"
        where = column
        if isinstance(value, list):
            if len(value) != 1:
                raise self._bad(row, column, value, expected)
            value, where = value[0], f"{column}[0]"
        if isinstance(value, dict):
            role, content = self._turn(row, where, value)
            if role != "assistant":
                role_tag = self.source.column("role_tag")
                raise self._bad(row, f"{where}.{role_tag}", value[role_tag], f"{assistant!r} (an answer)")
            return content
        if not isinstance(value, str):
            raise self._bad(row, column, value, expected)
        return value
