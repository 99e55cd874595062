"""A fixed English text for teacher-forced accuracy measures.

`bench/fp8_accuracy.py` scores the next-token distributions of FP8 against
f32 KV pages over this text. It lives here, unchanged, so the measure does
not move when documentation is edited; any change to it is a change of the
benchmark and invalidates earlier results.
"""

TEACHER_TEXT = """\
A language model writes one token at a time. Each new token attends to every \
token before it, so the keys and values of the earlier tokens are kept in \
memory instead of being computed again at every step. This store is called \
the key-value cache, and for long conversations it is larger than the model \
itself.

A paged cache cuts that memory into blocks of a fixed number of tokens, much \
as an operating system cuts a process's memory into pages. A sequence owns a \
list of blocks, its page table, and the blocks of one sequence need not be \
next to each other. When a sequence ends, its blocks return to a free list, \
and another sequence can use them at once. Nothing has to be moved or copied, \
and no memory is reserved for tokens that were never written.

Two requests that begin with the same text, such as a long system prompt, can \
share the blocks of that text. The cache hashes each full block together with \
the hash of the block before it, so a block is found only when the whole \
prefix up to it matches. The tokens are compared as well, because two \
different prefixes may, rarely, give the same hash. A shared block is freed \
only when the last sequence that uses it has finished.

The attention kernel reads the blocks through the page table. For a single \
new token, the work is small and the time is spent reading memory, so the \
kernel is fast when it streams the cached keys and values at close to the \
speed of the memory. For a long prompt, the work grows with the square of its \
length, and the kernel is fast when the matrix units are kept busy. A server \
mixes both kinds of work in one batch: a few long prompts and many sequences \
that add one token each.

Storing the keys and values in eight bits instead of sixteen halves the memory \
they need and the bytes the kernel reads. Each layer keeps a scale for its \
keys and one for its values; a stored number times its scale gives back the \
value. The scales are chosen from the largest values seen on a few sample \
prompts, so that large values are not cut off and small ones keep enough \
precision. The cost is a small change in the model's predictions, which can \
be measured by comparing the next-token probabilities with and without the \
smaller format on the same text.

Sliding-window layers look only at the most recent tokens. Blocks that no \
future token can see are needed only while the current layer runs, so they \
can share a few scratch blocks instead of holding memory until the sequence \
ends. Models that mix windowed and global layers keep a separate set of blocks \
for each kind, and the cache gives each set its own free list.
"""
