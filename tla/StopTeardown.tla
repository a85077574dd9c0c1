---------------------------- MODULE StopTeardown ----------------------------
(***************************************************************************)
(* D8: what stop() does to a loop that a holder keeps paused.  An          *)
(* abstraction of the manager's stop(), not of the pause protocol (whose   *)
(* stop is PauseProtocol's RequestStop and StopReturnsProp): the pause is  *)
(* one step here, the loop a thread that steps its requests while it runs, *)
(* and the batch processor the object the steps need.                      *)
(*                                                                         *)
(* A thread calls stop(block=True, timeout=t) (a flush stop) and waits;    *)
(* when its wait runs out before the loop has stopped (or at once, for     *)
(* block=False), stop() returns.  transformers 5.23.0 then tears down at   *)
(* once: it clears the batch processor under the loop that still runs,     *)
(* and the loop's next step fails every request (TearDownEarly = TRUE).    *)
(* cbpause's integration leaves the teardown to the loop's own exit        *)
(* (TearDownEarly = FALSE): the loop flushes when the pause ends, every    *)
(* request finishes, then the processor is cleared.                        *)
(*                                                                         *)
(* TLC must find FlushFailsNothingInv violated for upstream                *)
(* (Upstream_D8) and must not for cbpause (StopTeardown_cbpause).          *)
(***************************************************************************)
EXTENDS Naturals

CONSTANTS
    Requests,       \* the requests in flight
    TearDownEarly   \* TRUE: upstream's stop(); FALSE: cbpause's

VARIABLES
    loop,       \* the loop: "running", "paused", "stopped"
    holder,     \* the holder: "idle", "inside", "done"
    stopper,    \* the thread in stop(): "idle", "waiting", "returned"
    processor,  \* the batch processor: "ready", "cleared"
    request,    \* each request: "active", "finished", "failed"
    delivered   \* each request's outputs delivered

vars == <<loop, holder, stopper, processor, request, delivered>>

TypeOK ==
    /\ loop \in {"running", "paused", "stopped"}
    /\ holder \in {"idle", "inside", "done"}
    /\ stopper \in {"idle", "waiting", "returned"}
    /\ processor \in {"ready", "cleared"}
    /\ request \in [Requests -> {"active", "finished", "failed"}]
    /\ delivered \in [Requests -> 0..1]

Init ==
    /\ loop = "running"
    /\ holder = "idle"
    /\ stopper = "idle"
    /\ processor = "ready"
    /\ request = [i \in Requests |-> "active"]
    /\ delivered = [i \in Requests |-> 0]

Active == {i \in Requests : request[i] = "active"}

\* pause(), entered at once (the protocol's entry is checked elsewhere).
Pause ==
    /\ holder = "idle" /\ loop = "running"
    /\ holder' = "inside" /\ loop' = "paused"
    /\ UNCHANGED <<stopper, processor, request, delivered>>

Resume ==
    /\ holder = "inside"
    /\ holder' = "done" /\ loop' = "running"
    /\ UNCHANGED <<stopper, processor, request, delivered>>

\* stop(block=True, timeout=t): ask a flush stop, wait for the loop.
RequestStop ==
    /\ stopper = "idle"
    /\ stopper' = "waiting"
    /\ UNCHANGED <<loop, holder, processor, request, delivered>>

\* The wait runs out with the loop still running or paused; stop() returns
\* and upstream tears the loop down there and then.
StopWaitRunsOut ==
    /\ stopper = "waiting" /\ loop # "stopped"
    /\ stopper' = "returned"
    /\ processor' = IF TearDownEarly THEN "cleared" ELSE processor
    /\ UNCHANGED <<loop, holder, request, delivered>>

\* The loop has stopped before the wait ran out.
StopReturns ==
    /\ stopper = "waiting" /\ loop = "stopped"
    /\ stopper' = "returned"
    /\ UNCHANGED <<loop, holder, processor, request, delivered>>

\* A forward step: one request finishes; without a batch processor the step
\* raises and the loop's error handler fails every request and stops.
Step ==
    /\ loop = "running" /\ Active # {}
    /\ IF processor = "ready"
       THEN \E i \in Active :
                /\ request' = [request EXCEPT ![i] = "finished"]
                /\ delivered' = [delivered EXCEPT ![i] = 1]
                /\ UNCHANGED loop
       ELSE /\ request' = [i \in Requests |-> IF request[i] = "active" THEN "failed" ELSE request[i]]
            /\ delivered' = [i \in Requests |-> IF request[i] = "active" THEN 1 ELSE delivered[i]]
            /\ loop' = "stopped"
    /\ UNCHANGED <<holder, stopper, processor>>

\* A flush stop with nothing left to step: the loop exits and tears down.
ExitLoop ==
    /\ loop = "running" /\ stopper # "idle" /\ Active = {}
    /\ loop' = "stopped" /\ processor' = "cleared"
    /\ UNCHANGED <<holder, stopper, request, delivered>>

\* The story is over (PauseProtocol's Terminated): no deadlock.
Terminated == loop = "stopped" /\ stopper = "returned" /\ holder # "inside" /\ UNCHANGED vars

Next ==
    \/ Pause \/ Resume \/ RequestStop \/ StopWaitRunsOut \/ StopReturns \/ Step \/ ExitLoop
    \/ Terminated

\* The loop's thread runs while it has work or a stop to finish (PauseProtocol's
\* weak fairness of the loop, spec section 4.4); a stop() that waits returns
\* once the thread has ended (Thread.join).  That the holder leaves is no
\* part of the spec: it is the premise of FlushFinishesProp.
Spec == Init /\ [][Next]_vars /\ WF_vars(Step) /\ WF_vars(ExitLoop) /\ WF_vars(StopReturns)

\* A flush stop fails no request: nothing else goes wrong in this model, so
\* every request in flight must finish.
FlushFailsNothingInv == \A i \in Requests : request[i] # "failed"

\* Every request gets its output, and a stop waited for completes, provided
\* the holder inside leaves (R-STOP-RETURNS's premise, HoldersLeave).
FlushFinishesProp ==
    WF_vars(Resume) =>
        /\ <>(\A i \in Requests : delivered[i] = 1)
        /\ (stopper = "waiting") ~> (loop = "stopped")

\* Witnesses (must fail, models.toml): a request does finish, and the loop does
\* tear down, in the end.
NeverFinishesWitness == \A i \in Requests : request[i] # "finished"
NeverTearsDownWitness == processor = "ready"
=============================================================================
