"""A lost node, told apart from the run's own errors.

When a node holding actors of the run goes, calls to its actors fail at once, but only Ray's verdict says which node
it was. The trainer watches the nodes of its actors (cluster.NodeWatch) when some run away from the driver's node;
`NodeLossHandling` is the trainer's side of that watch: it stops the producer, wakes or interrupts the trainer
thread, and turns the failure into a NodeLostError naming the node.
"""

from __future__ import annotations

import _thread
import queue
import threading

import ray

from entropy_openrlhf.cluster import NODE_VERDICT_S, LostNode, NodeWatch


class NodeLostError(RuntimeError):
    """A node that held actors of the run was lost (Ray declared it dead); the run cannot go on without them."""

    def __init__(self, lost: list[LostNode], step: int, seconds_after: float | None):
        self.lost, self.step = lost, step
        after = "" if seconds_after is None else f"; the run stopped {seconds_after:.0f} s after Ray declared it dead"
        nodes = " and ".join(n.describe() for n in lost)
        super().__init__(f"lost {nodes}, during step {step}{after}")


# Errors a call to an actor on a lost node fails with before Ray declares the node dead: unreachable
# (ActorUnavailableError, a RayActorError) or died. A wait that runs out is no such sign: a lost node fails the calls
# to its actors at once, and a wait on the surviving nodes outlasts Ray's verdict, which the node watch has by then.
NODE_LOSS_SYMPTOMS = (
    ray.exceptions.RayActorError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.ObjectLostError,
)
# How long the trainer thread may go on after the node watch has seen a lost node before it is interrupted. Its
# calls to the lost node's actors fail as soon as Ray declares the node dead; a wait that involves only surviving
# nodes (a collective the lost peer never joins, which ends at its own timeout) would hold it longer.
LOST_NODE_GRACE_S = 30.0


def _causes(e: BaseException | None):
    """`e` and the exceptions it was raised from, or while handling."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


class NodeLossHandling:
    """The trainer's reactions to a lost node (a mixin of Trainer). It reads the trainer's `stop` event, its
    condition `cond`, its batch `queue` and whether the step loop runs (`_in_loop`, `_on_main_thread`)."""

    stop: threading.Event
    cond: threading.Condition
    queue: queue.Queue
    _in_loop: bool
    _on_main_thread: bool

    def _on_node_lost(self, lost: list[LostNode]) -> None:
        """The node watch's callback (its own thread): stop producing, wake the trainer thread if it waits for a
        batch, and interrupt it if it is still in the step loop LOST_NODE_GRACE_S later."""
        print(f"[entropy-openrlhf] Ray declared lost: {' and '.join(n.describe() for n in lost)}", flush=True)
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        try:
            self.queue.put_nowait(RuntimeError("a node holding actors of this run was lost"))
        except queue.Full:  # a batch is waiting: the trainer is not blocked on the queue
            pass

        def interrupt() -> None:
            if self._in_loop and self._on_main_thread:
                print(f"[entropy-openrlhf] the trainer is still waiting {LOST_NODE_GRACE_S:.0f} s after the node was "
                      "lost: interrupting it", flush=True)  # fmt: skip
                _thread.interrupt_main()  # a KeyboardInterrupt, which run() turns into NodeLostError

        timer = threading.Timer(LOST_NODE_GRACE_S, interrupt)
        timer.daemon = True
        timer.start()

    def _lost_nodes_behind(self, error: BaseException, watch: NodeWatch | None) -> list[LostNode]:
        """The lost nodes that explain `error`: those the watch has seen, or, when the error is what a call to an
        actor on a lost node fails with (unreachable, died), those Ray declares dead within NODE_VERDICT_S. Empty when
        no node holding actors of the run was lost (the error is the run's own)."""
        if watch is None:
            return []
        try:
            if watch.check():
                return watch.lost
            if isinstance(error, KeyboardInterrupt):  # Ctrl-C, not the watch's interrupt
                return []
            symptom = next((c for c in _causes(error) if isinstance(c, NODE_LOSS_SYMPTOMS)), None)
            if symptom is None:
                return []
            first_line = (str(symptom).splitlines() or [""])[0][:200]
            print(f"[entropy-openrlhf] {type(symptom).__name__}: {first_line}; waiting up to {NODE_VERDICT_S:.0f} s "
                  "for Ray's verdict on the nodes of this run's actors", flush=True)  # fmt: skip
            return watch.verdict(NODE_VERDICT_S)
        except Exception as e:  # noqa: BLE001 - the run's own error matters more than why the check failed
            print(f"[entropy-openrlhf] could not check the cluster's nodes: {e}", flush=True)
            return []
