"""`ChunkLifecycle`: the chunk handlers from their forward to their retirement.

It owns the chunk forward in progress (the only handler in phase FORWARD), decides what
happens to a forward's last groups when the forward ends, starts each handler's backward, and
retires handlers once autograd has freed all their saved tensors.

The last-layer rule. A chunk's last group of each name waits for a decision (`end_forward`):
kept on the GPU when the next thing the engine sees is that chunk's own backward (offloading
it would copy it out and straight back), offloaded when anything else comes first: another
chunk's forward, another chunk's backward, or the end of the iteration.

The forward's end. The lifecycle remembers, from each chunk's previous forward, the layer of
each name's last invocation, offloaded or declined by the group policy (`known_not_last`; Note
[11] of `offload.copy_queue`): a group before it is decided when it closes, and its copies are
issued at the next group open (Note [7] of `offload.copy_queue`), so the copies of a chunk's
second-to-last layer run under its last layer, within the in-flight bound as everywhere else.
(In a chunk's first forward a group is decided only when the next group of its name closes, or
the next invocation of its name is declined.) Whatever is still in flight when the forward's
last group closes would hold its memory through the forward's end, where a step's memory often
peaks. So the lifecycle also remembers which invocation closed last (`closes_forward`): when it
closes, the records held elsewhere get their second look, and the compute stream waits for the
copies in flight and their memory is freed. One wait per forward: a wait at the last group of
each name would stall the compute stream on the copies of every name's second-to-last group as
soon as each is issued, with no compute left to hide them. The first forward of a chunk cannot
know its last group: its copies are waited for when its backward starts (or by the in-flight
bound).

Where the schedule is known (`set_schedule`) and says a chunk forward's own backward does not
come next, that forward is over when the attached model's forward returns
(`PipelineOffloadManager.model_forward_returned`): its last groups are offloaded there, not
when the next chunk starts. In a pipeline's steady state the next chunk is another chunk's
backward, whose start (`begin_backward`) makes the compute stream wait for those copies: they
ran under the exchange between the stages and the modules of that backward before its first
group, and their memory is freed before its first group's backward. Issued at that backward's
start instead, they were still in flight at its next group, as the host runs ahead of the GPU:
one layer's worth more at the step's peak (Megatron's dense GPT at 16K, PP=2 VPP=2: a fused
attention backward's workspace in the first layer of a chunk's backward).

With ``copies_into_backward`` (`offload.config.OffloadConfig`) the last group's close issues
what is decided but waits for nothing: the copies run on under the forward's tail (the last
layer's remaining modules, the head, the loss) and the backward's first modules, and the
compute stream waits for them when the backward starts (`begin_backward`, as after a first
forward). Their memory is held through the tail: free where the step peaks later in the
backward, up to their bytes where the forward's end is the peak. Whether a step peaks in its
backward is the user's to know (`max_memory_allocated` with the option and without); the
engine cannot see where the allocator's peak falls without resetting its peak statistics.
"""

from __future__ import annotations

from typing import Any

from .backward_order import BackwardOrder
from .chunk_handler import ChunkOffloadHandler, HandlerPhase
from .copy_queue import CopyQueue
from .group import GroupState, OffloadGroup
from .stats import StatsRecorder


class ChunkLifecycle:
    """Creates, ends, starts the backward of, and retires `ChunkOffloadHandler`s."""

    def __init__(self, order: BackwardOrder, copies: CopyQueue, stats: StatsRecorder) -> None:
        self.order = order
        self.copies = copies
        self.stats = stats
        self.forward: ChunkOffloadHandler | None = None  # the chunk forward in progress
        self._idle: list[ChunkOffloadHandler] = []  # handlers whose handles are all freed
        self._closed_last: dict[int, tuple[str, int]] = {}  # chunk -> (name, layer) of its forward's last group
        self._last_layers: dict[int, dict[str, int]] = {}  # chunk -> name -> its forward's last group's layer

    def start(self, chunk_id: int, microbatch: int | None, session: Any) -> ChunkOffloadHandler:
        """A new chunk forward: number it, make its handler and queue it in backward order.
        Under capture (``session``) the handler is the graph's own: no schedule bookkeeping
        (a graph is captured once and replayed in many iterations)."""
        iteration = self.order.iteration
        if session is not None:
            handler = ChunkOffloadHandler(chunk_id, microbatch or 0, iteration, "captured", 1, (iteration, -1),
                                          session, self._note_idle, self.stats)
            self.order.add_unordered(handler)
        else:
            slot = self.order.next_forward(chunk_id, microbatch)
            handler = ChunkOffloadHandler(chunk_id, slot.microbatch, iteration, slot.phase, slot.live,
                                          slot.sort_key, None, self._note_idle, self.stats,
                                          slot.own_backward_next)
            self.order.add(handler)
        self.stats.handlers += 1
        self.forward = handler
        return handler

    def end_forward(self, keep: bool) -> list[str]:
        """The chunk forward in progress (if any) is over. Its last groups are kept on the GPU
        (``keep``: its own backward follows, or a capture boundary cuts the forward) or
        offloaded now; offloaded, their copies have just started, so the compute stream does
        not wait for them here: the in-flight bound applies when the next group opens. Not
        kept, the records that were held elsewhere when their groups' copies were issued get a
        second look (Note [8] of `offload.copy_queue`). Returns the labels of those groups."""
        handler = self.forward
        if handler is None:
            return []
        if not keep:
            self.copies.offload_released(handler)  # Note [8] of offload.copy_queue
            self.copies.launch_deferred(bound=False)
        if handler.last_closed is not None:
            self._closed_last[handler.chunk_id] = handler.last_closed
            self._last_layers[handler.chunk_id] = {name: count - 1 for name, count in handler.invocations.items()}
        pending = self.hand_over_forward()
        if keep:
            self.keep(pending)
        else:
            for group in pending:
                self.copies.offload(group, bound=False)
        return [group.label for group in pending]

    def model_returned(self, handler: ChunkOffloadHandler) -> None:
        """``handler``'s model returned (the forward's end above): over now if the schedule says
        its own backward is not next; else its records held elsewhere get a look (Note [8] of
        `offload.copy_queue`), its last groups still waiting for what comes next."""
        if handler.own_backward_next is False:
            self.end_forward(keep=False)
        else:
            self.copies.offload_released(handler)

    def hand_over_forward(self) -> list[OffloadGroup]:
        """The chunk forward in progress (if any) is over, and its groups still waiting for
        the last-layer decision go to the caller undecided (a forward cut at a CUDA graph's
        edge: Note [C1] of `offload.capture`)."""
        handler = self.forward
        if handler is None:
            return []
        self.forward = None
        pending = handler.take_pending()
        handler.advance(HandlerPhase.FORWARD_DONE)
        return pending

    def keep(self, groups: list[OffloadGroup]) -> None:
        """These groups, waiting for their offload, stay on the GPU instead."""
        for group in groups:
            group.advance(GroupState.KEPT)
            self.stats[group.name].groups_kept += 1

    def closes_forward(self, handler: ChunkOffloadHandler, name: str, layer: int) -> bool:
        """Whether invocation ``layer`` of ``name`` is the one that closed last in ``handler``'s
        chunk's previous forward (offloaded or declined by the group policy)."""
        return self._closed_last.get(handler.chunk_id) == (name, layer)

    def known_not_last(self, group: OffloadGroup) -> bool:
        """Whether ``group`` comes before its name's last invocation (offloaded or declined by
        the group policy) in its chunk's previous forward."""
        layers = self._last_layers.get(group.handler.chunk_id)
        return layers is not None and group.layer < layers.get(group.name, -1)

    def begin_backward(self, handler: ChunkOffloadHandler) -> None:
        """The first backward activity of ``handler``. If its forward was the last thing that
        ran, its last groups stay on the GPU (the last-layer rule), unless it ran in a graph
        region (planned as it will be captured: nothing kept). The copies in flight are waited
        for (on the GPU) so the backward starts with their memory freed; any other chunk still
        in forward is finished, and its last groups copy out while this backward runs. Then
        ``handler``'s records held elsewhere get their last look (Note [8] of
        `offload.copy_queue`): those now only ours copy out under this backward, unwaited."""
        self.copies.flush()
        self.end_forward(keep=handler is self.forward and not handler.graphable)
        handler.advance(HandlerPhase.BACKWARD)
        self.order.backward_began(handler)
        if handler.capture is None:
            self.copies.offload_released(handler)  # Note [8] of offload.copy_queue

    def _note_idle(self, handler: ChunkOffloadHandler) -> None:
        self._idle.append(handler)  # from a handle's __del__: retired later, at a safe point

    def retire_idle(self, graveyard: list[OffloadGroup] | None = None) -> None:
        """Retire the handlers whose saved tensors autograd has all freed, never the chunk
        still in forward. With a ``graveyard`` (a capture begins) only handlers that hold no
        device memory are retired, and their groups (with their events) go there to outlive
        the capture."""
        if not self._idle:
            return
        candidates, self._idle = self._idle, []
        for handler in candidates:
            if handler.alive != 0 or handler.phase is HandlerPhase.RETIRED or handler.capture is not None:
                continue  # a captured handler's buffers belong to its graphs (`release_graphs`)
            if handler is self.forward or (graveyard is not None and not handler.holds_no_device_memory()):
                self._idle.append(handler)  # later: once its forward is over, or out of the capture
                continue
            if graveyard is not None:
                graveyard.extend(handler.groups)
            self.retire(handler)

    def retire(self, handler: ChunkOffloadHandler) -> None:
        """Give back everything ``handler`` holds and take it out of the backward order."""
        handler.retire(self.copies)
        self.order.remove(handler)

    def reset(self) -> None:
        """Retire every handler (the caller made the compute stream wait for all copies)."""
        for handler in list(self.order.handlers):
            self.retire(handler)
        self.order.reset()
        self._idle.clear()
        self._closed_last.clear()
        self._last_layers.clear()
        self.forward = None
