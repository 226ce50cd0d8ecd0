"""The tokenized cache's format version, part of every cache key (open_sft.data.cache): a change to what the cache
holds for some rows bumps it, so no run reads a cache an older open_sft wrote. The history says what each version
changed."""

# 2: the rows' `tools` column reaches the chat template; 3: labels are int32; 4: each content is labelled
# where the template wrote it (Qwen3's think block, Phi-3's final eos), rows may open with the assistant,
# messages keep their tool_calls (trained as written) and other fields; 5: open-instruct's templates under
# their names, a turn closed differently when another follows (OLMo's <|im_end|>) trains that closing; 6: an
# alpaca row's `history` turns (LLaMA-Factory's format) come before its own, not dropped; 7: assistant turns
# in a TRL prompt-completion row's prompt are context, not trained; 8: --dataset_mixer_unit tokens counts the
# tokens a row keeps after --max_seq_length, and text documents open with bos where the tokenizer's encoding does;
# 9: every assistant turn trains as the model generates it (after the context its template gives it, through the
# token that ends it: a conversation may make several examples), reasoning is handed over under the template's name;
# 10: tool calls read through Arrow lose its filled-in nulls, JSON-string arguments are objects, content parts,
# a row's system column, turns after the last answer left out, sharegpt function_call turns are tool calls, TRL's
# string prompt-completion rows raw text, --reasoning_loss mask masks inline <think> traces, OpenAI's weight 0;
# 11: --dataset_mixer_unit tokens orders its picks as rows does (an upsampled document's copies a pass apart), a
# UTF-8 BOM opening a .txt file is not the first document's text, --add_bos where bos is eos puts one eos between
# documents (not two); 12: a template writing the system prompt into the last user turn only while it is the last
# message (Mistral v0.3's, Nemo's) trains each turn after its generation context, the system prompt in it; 13: a
# turn with reasoning whose generation prompt closes an empty think block (enable_thinking false) trains its answer
# after that prompt; 14: a turn closer spelled like a tag (Gemma's <end_of_turn>) ends turns trained turn by turn;
# 15: a TRL string prompt-completion row's bos is the token the tokenizer's encoding opens a text with, not text
# before the prompt (sentencepiece tokenizers lost the prompt's first "▁"); 16: a template that concatenates
# tool-call arguments (DeepSeek-R1's) gets them as strings (its tool-call rows were refused); 17: the context of a
# turn that writes only part of its generation prompt's opening ends at a whole tag or line; 18: a turn trains
# through the first stop token the template writes for it where only tags follow (DeepSeek-R1's extra
# <｜Assistant｜><｜end▁of▁sentence｜> after a call's empty content is context); 19: a turn that cannot be located after
# its own context trains alone in the one rendering, the row's other turns after theirs (Mistral v0.3's system prompt);
# 20: whitespace a template writes after the generation prompt (a content's own leading "\n\n", Mistral's space after
# [/INST]) trains in a row's one rendering too, as turn by turn; 21: a tool call that ends the row stops at the tag of
# a tool's result under a template without end-of-turn tokens (GLM-4.5's <|observation|>, not <|user|>); 22: OpenAI's
# legacy functions/function_call/function rows are tools, tool calls and tool results (the calls were dropped); 23: a
# turn whose generation prompt opens a think block the template leaves out (DeepSeek-R1 distills', QwQ's) trains its
# trace, </think> and answer after that prompt (it trained the answer alone, after part of the prompt), the prompt and
# what follows it tokenized apart (a "\n" ending the prompt no longer merges with the trained text's first "\n");
# 24: a special token closing a start/end pair the turn opened (LFM2's <|tool_call_end|>) is no end of turn (call
# turns in history trained without their <|im_end|>); 25: a turn whose rendering as the last message holds a stop token
# with text after it (Nemotron-Nano-v2's content and calls as two turns) trains as the template writes it in history;
# 26: a template writing an object's arguments as Python's repr (Apriel-1.5's |string) gets them as strings; 27: Gemma
# 4's <tool_call|> closes the call the turn opened (no end of turn), and a generation prompt's empty thought channel
# is context; 28: a tag closing a call the turn opened, in any spelling (<|/tool_call|>, </seed:tool_call>), is not an
# end of turn, a row lacking the tool call ids its template writes is a bad row, Llama's ipython role is a tool message,
# a generation prompt written after every conversation (Command R7B's) is not trained after the last turn; 29: a turn
# whose think block the template writes empty though it writes traces elsewhere (Kimi-K2-Thinking's final answers)
# trains its trace in that block, and a special token a turn writes before its content (Kimi-K3's <|close|>, <|sep|>)
# is no end of turn; 30: a turn whose generation prompt leaves out the header the template writes before it (Gemma
# 4's after tool_responses) trains without it; 31: a trace in the content in the template's own block, which it would
# write after its own (Kimi-K2-Thinking's), is the turn's trace, written once; 32: a template closing every message
# with a separator that a call turn also writes before its call (GigaChat3's <|message_sep|>) has its turns end with
# eos in the separator's place (its call turns were bad rows); 33: text a template writes in an assistant message from
# a field the model does not write (Gemma 4's tool_responses) is context past the token opening it, where the turn
# stops; 34: a generation prompt opening the trace with words (Apriel-1.6's "Here are my reasoning steps:\n") is the
# turn's whole context, an empty trace closed where none; 35: the report names the special tokens whose text the rows
# hold (special_tokens_in_text_by_token), those the user added (--add_special_tokens) not counted; 36: from/value
# weight 0 is context, JSON-string turns/schemas and dataset_shapes.py rows read, tools_listed_twice in the report;
# 37: an answer after a tool result that the template closes otherwise once a turn follows (Hermes 2 Pro's, 3's)
# trains after its prompt (a bad row), a trailer written after every rendering (Hunyuan's empty think block) is
# context before each turn, an assistant's thinking parts (Magistral's) are its trace, content_not_rendered in the
# report; 38: a text column beside question/answer is documents, question/answer with unknown columns refused, thinking
# parts beside an empty reasoning field are the trace, glaive calls without a string name or JSON-object arguments (or
# without schemas) bad rows, s1K-1.1 rows with an 'attempt' column read, xLAM parameters named 'properties' wrapped,
# the {% generation %} check admitting only the generation prompt before a trained run; 39: a row's own
# chat_template_kwargs column (smoltalk2's) renders it, over --chat_template_kwargs (it was ignored), and a content's
# [THINK]…[/THINK] where Magistral's template writes them is not counted as special_tokens_in_text, and xLAM's Python
# type names are JSON Schema's (str → string, ...), `, optional` ones not required, the others required; 40: a
# content's special tokens around a trace are the template's own only where it renders that inline form as the trace
# given apart (gpt-oss's <|message|>x<|end|>y is counted as special_tokens_in_text again), an xLAM parameter with a
# default, Optional[X] (typed X) or `,optional` in any spacing is not required, and row_template_kwargs counts only
# rows whose variables differ from the source's; 41: a content's trace block is the template's own only where the
# message gives no trace apart (Magistral's [THINK]c[/THINK][THINK]a[/THINK]b is counted again); 42: an xLAM
# parameter typed `X | None`, `None | X` or `X, optional, default=...` is typed X and not required; 43: a fraction f of
# a source's n rows takes floor(f × n) of them, as open-instruct (round() took one more where the rest was ≥ a half)
CACHE_FORMAT_VERSION = 43
