------------------------- MODULE TracePauseProtocol -------------------------
(***************************************************************************)
(* Trace validation (as etcd-raft and CCF do it): replay a log recorded    *)
(* from PauseProtocol objects (cbpause.recorder, written by cbpause.tlc.traces) against PauseProtocol.      *)
(* Each log entry names the action, its rank and holder, and the rank's    *)
(* state after the step; it must match an enabled action of the spec that  *)
(* leads to that state.  TLC accepts the trace when it reaches the end of  *)
(* the log, i.e. finds a state violating TraceNotAccepted.                 *)
(*                                                                         *)
(* Where the implementation is not atomic, and only there:                 *)
(*  - AllReduce, Barrier and Restart are one step of the whole group in    *)
(*    the spec and one call per rank in the code: the first rank's record  *)
(*    takes the group step, the others' records only check their state.    *)
(*    A holder's or stopper's record is checked only on what it shares     *)
(*    with the loop, whose record may lag the group step (Matches).        *)
(*  - StartStep: requests are not visible to PauseProtocol (the loop owns  *)
(*    them), so the trace runs with Requests = {} and TraceStartStep is    *)
(*    StartStep without its HasWork guard.                                 *)
(***************************************************************************)
EXTENDS PauseProtocol, Sequences

CONSTANT Log

VARIABLE i

TraceInit == Init /\ i = 0

TraceStartStep(r) ==
    /\ phase[r] = "body"
    /\ Move(r, "step")

\* A group step taken by the first rank to record it; later ranks stutter.
GroupStep(A, r, before) == IF phase[r] = before THEN A ELSE UNCHANGED vars

Step(e) ==
    LET r == e.r
        h == e.h
    IN CASE e.a = "Observe"           -> Observe(r)
         [] e.a = "AllReduce"         -> GroupStep(AllReduce, r, "reduce")
         [] e.a = "OpenWindow"        -> OpenWindow(r)
         [] e.a = "SkipWindow"        -> SkipWindow(r)
         [] e.a = "ParkForPeer"       -> ParkForPeer(r)
         [] e.a = "JoinPeerPause"     -> JoinPeerPause(r)
         [] e.a = "PeerParkTimeout"   -> PeerParkTimeout(r)
         [] e.a = "CollectiveTimeout" -> CollectiveTimeout(r)
         [] e.a = "CloseWindow"       -> CloseWindow(r)
         [] e.a = "Barrier"           -> GroupStep(Barrier, r, "barrier")
         [] e.a = "NoPause"           -> NoPause(r)
         [] e.a = "StartStep"         -> TraceStartStep(r)
         [] e.a = "EndStep"           -> EndStep(r)
         [] e.a = "Idle"              -> Idle(r)
         [] e.a = "ExitLoop"          -> ExitLoop(r)
         [] e.a = "RequestPause"      -> RequestPause(h)
         [] e.a = "EnterPause"        -> EnterPause(h)
         [] e.a = "LeavePause"        -> LeavePause(h)
         [] e.a = "PauseFails"        -> PauseFails(h)
         [] e.a = "Interrupt"         -> Interrupt(h)
         [] e.a = "PauseTimeout"      -> PauseTimeout(h)
         [] e.a = "RequestStop"       -> RequestStop(r, e.s)
         [] e.a = "RecordFatalError"  -> RecordFatalError(r)
         [] e.a = "Restart"           -> GroupStep(Restart, r, "stopped")
         [] OTHER                     -> FALSE

\* Steps taken by threads other than the loop: holders and stoppers.
OtherThreadActions ==
    {"RequestPause", "EnterPause", "LeavePause", "PauseFails", "Interrupt",
     "PauseTimeout", "RequestStop"}

\* The rank's variables after the step are the recorded ones.  A holder's or
\* stopper's step is checked on the variables those threads share with the
\* loop and no group step changes (count, paused, fatal): the loop of its rank
\* may not have recorded its part of the last group step yet, so its phase,
\* localStatus, tpStatus, tpPause and obsStatus may lag the spec's; the
\* loop's own next record checks them.
Matches(e) ==
    LET r == e.r
        v == e.v
    IN /\ fatal'[r] = v.fatal
       /\ paused'[r] = v.paused
       /\ count'[r] = v.count
       /\ e.a \notin OtherThreadActions =>
             /\ localStatus'[r] = v.localStatus
             /\ phase'[r] = v.phase
             /\ tpStatus' = v.tpStatus
             /\ tpPause' = v.tpPause
             /\ obsStatus'[r] = v.obsStatus
             /\ obsPause'[r] = v.obsPause

TraceNext ==
    /\ i < Len(Log)
    /\ Step(Log[i + 1])
    /\ Matches(Log[i + 1])
    /\ i' = i + 1

\* Violated exactly when the whole log has been matched: the trace is accepted.
TraceNotAccepted == i < Len(Log)
=============================================================================
