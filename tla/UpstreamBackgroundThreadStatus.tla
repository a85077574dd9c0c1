------------------- MODULE UpstreamBackgroundThreadStatus -------------------
(***************************************************************************)
(* A faithful model of transformers 5.23.0's pause protocol                *)
(* (BackgroundThreadStatus in continuous_api.py, with                      *)
(* ContinuousBatchProcessor._update_tp_group_state, add_request,           *)
(* _handle_critical_error and start()), written as the differences from    *)
(* PauseProtocol so a reader sees exactly what we fix.  Everything not     *)
(* redefined here is upstream's behaviour too: waiting holders wake on     *)
(* `_paused or loop_is_done` (EnterPause, PauseFails), the count drops in  *)
(* _drop_pause_request (Drop), the MAX all-reduce and the barrier.         *)
(*                                                                         *)
(* What upstream does that PauseProtocol does not:                         *)
(*   - pause_and_wait() parks whoever asked (UpstreamOpenWindow);          *)
(*   - pause() admits a pause whatever the stop status                     *)
(*     (UpstreamRequestPause) and has no timeout (no PauseTimeout);        *)
(*   - release_pause() by a thread holding no pause (StrayRelease);        *)
(*   - add_request() checks, then enqueues, in two steps (UpstreamAdmit,   *)
(*     UpstreamEnqueue);                                                   *)
(*   - a hard stop, or a failure between the drain and the scheduler (the  *)
(*     all-reduce, the window, the barrier, the payload broadcast), drops  *)
(*     the payload drained from the queue (UpstreamFailRemaining);         *)
(*   - cancel_request() removes a request and delivers nothing             *)
(*     (UpstreamCancel);                                                   *)
(*   - a BaseException (KeyboardInterrupt, SystemExit) that reaches the    *)
(*     loop's thread skips _fail_all_remaining_requests: the thread ends   *)
(*     holding every request (UpstreamThreadKilled);                       *)
(*   - every failure runs one more all-reduce with HARD_STOP               *)
(*     (UpstreamCriticalError), the thread ending if that one fails too;   *)
(*   - start() calls clear() whatever the holders do (UpstreamRestart).   *)
(*                                                                         *)
(* TLC is expected to FIND these defects here (see models.toml):           *)
(*   D1  ResumeProp: a request withdrawn after the loop read it leaves     *)
(*       pause_and_wait() parked with nobody to release it, for ever.      *)
(*   D2  CountsInv: a stray release_pause() drives the count to -1.        *)
(*   D3  ResumeProp, TP=2: a rank parked for a peer's pause, with no local *)
(*       holder, waits for ever.                                           *)
(*   D5  NothingLostInv: the loop stops holding an accepted request that   *)
(*       will never get an output (drained, then dropped by a hard stop or *)
(*       a failed collective, the payload broadcast included; or enqueued  *)
(*       after the loop's last drain).                                     *)
(*   D7  UpstreamStopReturnsProp: two holders whose pauses overlap keep a  *)
(*       flush stop waiting for ever, though each of them leaves.          *)
(*   D9  NothingLostProp: a cancelled request never gets an output; its   *)
(*       caller waits for ever.                                            *)
(*   D10 NothingLostInv: a KeyboardInterrupt or SystemExit on the loop's   *)
(*       thread stops it holding requests that never get an output.        *)
(***************************************************************************)
EXTENDS PauseProtocol

\* A request whose add_request() passed its check and has not enqueued yet is
\* "admitted", and one removed by cancel_request() is "cancelled": request
\* states of upstream's only (PauseProtocol's submit is one step, and its
\* cancellation delivers an output), so these models do not check TypeOK.

-----------------------------------------------------------------------------
(* Requests.                                                               *)

\* _fail_all_remaining_requests(): fails the input queue and the scheduler's
\* requests; the payload in hand (drained, not broadcast and admitted yet) is
\* in a local variable of _update_tp_group_state, in neither, and is lost (D5).
UpstreamFailRemaining(r) ==
    IF r = Driver
    THEN /\ req' = [i \in Requests |-> IF req[i] \in Held \ {"drained"} THEN "done" ELSE req[i]]
         /\ out' = [i \in Requests |-> IF req[i] \in Held \ {"drained"} THEN out[i] + 1 ELSE out[i]]
    ELSE UNCHANGED requestVars

\* cancel_request(): the cancellation reaches the scheduler with the next
\* payload, and clear_cancelled_requests() removes the request; nothing is
\* delivered (D9).  The caller's choice: no fairness.
UpstreamCancel(i) ==
    /\ req[i] \in Held
    /\ phase[Driver] # "dead"
    /\ req' = [req EXCEPT ![i] = "cancelled"]
    /\ UNCHANGED <<loopVars, groupVars, holderVars, out, restarts>>

\* can_accept_new_requests(): no fatal error and no stop asked.  It does not
\* look at the loop's thread.
UpstreamAccepting == localStatus[Driver] = DONT_STOP /\ ~fatal[Driver]

\* add_request(), first half: the check.
UpstreamAdmit(i) ==
    /\ req[i] = "new"
    /\ req' = [req EXCEPT ![i] = IF UpstreamAccepting THEN "admitted" ELSE "rejected"]
    /\ UNCHANGED <<loopVars, groupVars, holderVars, out, restarts>>

\* add_request(), second half: input_queue.put(), whatever the loop did since.
UpstreamEnqueue(i) ==
    /\ req[i] = "admitted"
    /\ req' = [req EXCEPT ![i] = "queued"]
    /\ UNCHANGED <<loopVars, groupVars, holderVars, out, restarts>>

-----------------------------------------------------------------------------
(* The loop.                                                               *)

\* pause_and_wait(): set _paused and wait for it to go FALSE, whoever asked
\* and whether or not anybody is still pending.
UpstreamOpenWindow(r) ==
    /\ PauseDecided(r)
    /\ Park(r)

\* The loop's exits, with the drained payload dropped on a hard stop.
UpstreamExitLoop(r) ==
    /\ \/ phase[r] = "decided" /\ tpStatus = HARD_STOP
       \/ phase[r] = "body" /\ tpStatus = FLUSH_AND_STOP /\ ~PayloadPending /\ ~HasWork
    /\ localStatus' = [localStatus EXCEPT ![r] = STOPPED]
    /\ phase' = [phase EXCEPT ![r] = "stopped"]
    /\ UpstreamFailRemaining(r)
    /\ UNCHANGED <<obsStatus, obsPause, fatal, draining, groupVars, holderVars, restarts>>

\* _handle_critical_error(): request a hard stop, fail what remains, record
\* the error, then one more all-reduce with HARD_STOP (the rank joins the
\* group's collective again, wherever its peers are).
UpstreamCriticalError(r) ==
    /\ fatal' = [fatal EXCEPT ![r] = TRUE]
    /\ localStatus' = [localStatus EXCEPT ![r] = HARD_STOP]
    /\ obsStatus' = [obsStatus EXCEPT ![r] = HARD_STOP]
    /\ obsPause' = [obsPause EXCEPT ![r] = 0]
    /\ phase' = [phase EXCEPT ![r] = "reduce"]
    /\ UpstreamFailRemaining(r)
    /\ UNCHANGED <<draining, groupVars, holderVars, restarts>>

\* A collective times out (gloo's group timeout): the critical-error path,
\* whose extra all-reduce is one more collective; if that one times out
\* too, the exception leaves the handler and the thread marks itself stopped.
UpstreamCollectiveTimeout(r) ==
    /\ \/ phase[r] \in {"reduce", "barrier"}
       \/ phase[r] = "body" /\ PayloadPending     \* the payload broadcast
    /\ \E q \in Ranks : phase[q] # phase[r]
    /\ IF fatal[r]
       THEN /\ localStatus' = [localStatus EXCEPT ![r] = STOPPED]
            /\ phase' = [phase EXCEPT ![r] = "stopped"]
            /\ UNCHANGED <<obsStatus, obsPause, fatal, draining, groupVars, holderVars, requestVars, restarts>>
       ELSE UpstreamCriticalError(r)

\* An exception in the loop's own code outside a forward step and outside a
\* collective: the critical-error path too.
UpstreamFailLoop(r) ==
    /\ phase[r] = "decided"
    /\ ~fatal[r]
    /\ UpstreamCriticalError(r)

\* A BaseException that is not an Exception (KeyboardInterrupt, SystemExit)
\* reaches the loop's thread anywhere: _run_generation_loop catches Exception
\* only, so _handle_critical_error never runs; its finally marks the loop
\* stopped, holding whatever it held (D10).
UpstreamThreadKilled(r) ==
    /\ Live(r)
    /\ localStatus' = [localStatus EXCEPT ![r] = STOPPED]
    /\ phase' = [phase EXCEPT ![r] = "stopped"]
    /\ UNCHANGED <<obsStatus, obsPause, fatal, draining, groupVars, holderVars, requestVars, restarts>>

-----------------------------------------------------------------------------
(* Holders, stray releases, restarts.                                      *)

\* pause(): only checks that the generation thread is alive.
UpstreamRequestPause(h) ==
    LET r == RankOf[h] IN
    /\ hs[h] = "idle"
    /\ Live(r)
    /\ hs' = [hs EXCEPT ![h] = "waiting"]
    /\ hmode' = [hmode EXCEPT ![h] = KEEP]
    /\ count' = [count EXCEPT ![r] = count[r] + 1]
    /\ UNCHANGED <<loopVars, groupVars, paused, closing, requestVars, restarts>>

\* _drop_pause_request(): the count drops, and the window closes when it
\* reaches 0, whoever is still waiting or inside.
UpstreamDrop(h) ==
    LET r == RankOf[h] IN
    /\ hs' = [hs EXCEPT ![h] = "idle"]
    /\ hmode' = [hmode EXCEPT ![h] = 0]
    /\ count' = [count EXCEPT ![r] = count[r] - 1]
    /\ paused' = IF count[r] - 1 = 0 THEN [paused EXCEPT ![r] = FALSE] ELSE paused
    /\ UNCHANGED <<loopVars, groupVars, closing, requestVars, restarts>>

UpstreamLeavePause(h) == hs[h] = "inside" /\ phase[RankOf[h]] # "dead" /\ UpstreamDrop(h)
UpstreamInterrupt(h) == hs[h] = "waiting" /\ phase[RankOf[h]] # "dead" /\ UpstreamDrop(h)
UpstreamPauseFails(h) ==
    LET r == RankOf[h] IN
    /\ hs[h] = "waiting"
    /\ ~paused[r]
    /\ localStatus[r] = STOPPED \/ fatal[r]
    /\ phase[r] # "dead"
    /\ UpstreamDrop(h)
UpstreamHolderWakes(h) == EnterPause(h) \/ UpstreamPauseFails(h)

\* is_pause_requested(): the count, whoever holds it.
UpstreamObserve(r) ==
    /\ phase[r] = "read"
    /\ phase' = [phase EXCEPT ![r] = "reduce"]
    /\ obsStatus' = [obsStatus EXCEPT ![r] = localStatus[r]]
    /\ obsPause' = [obsPause EXCEPT ![r] = IF count[r] > 0 THEN KEEP ELSE 0]
    /\ req' = IF r = Driver
              THEN [i \in Requests |-> IF req[i] = "queued" THEN "drained" ELSE req[i]]
              ELSE req
    /\ UNCHANGED <<localStatus, fatal, draining, groupVars, holderVars, out, restarts>>

\* release_pause() by a thread that holds no pause: _drop_pause_request
\* runs anyway.
StrayRelease(r) ==
    /\ count' = [count EXCEPT ![r] = count[r] - 1]
    /\ paused' = IF count[r] - 1 = 0 THEN [paused EXCEPT ![r] = FALSE] ELSE paused
    /\ UNCHANGED <<loopVars, groupVars, hs, hmode, closing, requestVars, restarts>>

\* start() calls clear() whenever the thread is not running: the counts and
\* the window are reset even while holders wait or are inside.
UpstreamRestart ==
    /\ \A r \in Ranks : phase[r] = "stopped"
    /\ phase' = [r \in Ranks |-> "read"]
    /\ localStatus' = [r \in Ranks |-> DONT_STOP]
    /\ obsStatus' = [r \in Ranks |-> DONT_STOP]
    /\ obsPause' = [r \in Ranks |-> 0]
    /\ fatal' = [r \in Ranks |-> FALSE]
    /\ draining' = [r \in Ranks |-> FALSE]
    /\ tpStatus' = DONT_STOP
    /\ tpPause' = 0
    /\ count' = [r \in Ranks |-> 0]
    /\ paused' = [r \in Ranks |-> FALSE]
    /\ restarts' = restarts + 1
    /\ UNCHANGED <<hs, hmode, closing, requestVars>>

-----------------------------------------------------------------------------

UpstreamLoopAction(r) ==
    \/ UpstreamObserve(r) \/ UpstreamOpenWindow(r) \/ UpstreamCollectiveTimeout(r)
    \/ CloseWindow(r) \/ NoPause(r) \/ StartStep(r) \/ EndStep(r) \/ Idle(r)
    \/ UpstreamExitLoop(r)

UpstreamSystemNext ==
    \/ \E r \in Ranks : UpstreamLoopAction(r)
    \/ AllReduce \/ Barrier \/ Broadcast
    \/ \E h \in Holders : UpstreamRequestPause(h) \/ UpstreamHolderWakes(h) \/ UpstreamLeavePause(h)
    \/ \E i \in Requests : UpstreamAdmit(i) \/ UpstreamEnqueue(i) \/ Deliver(i)
    \/ Terminated

UpstreamEnvironmentNext ==
    \/ \E h \in Holders : UpstreamInterrupt(h)
    \/ \E r \in Ranks : \E s \in {FLUSH_AND_STOP, HARD_STOP} : RequestStop(r, s)
    \/ \E r \in Ranks : RecordFatalError(r) \/ UpstreamFailLoop(r) \/ Crash(r) \/ StrayRelease(r)
    \/ UpstreamRestart

UpstreamNext == UpstreamSystemNext \/ UpstreamEnvironmentNext

\* PauseProtocol's fairness, for upstream's actions; a caller that passed
\* add_request()'s check goes on to enqueue.
UpstreamFairness ==
    /\ \A r \in Ranks : WF_vars(UpstreamLoopAction(r))
    /\ WF_vars(AllReduce)
    /\ WF_vars(Barrier)
    /\ WF_vars(Broadcast)
    /\ \A h \in Holders : WF_vars(UpstreamHolderWakes(h))
    /\ \A i \in Requests : WF_vars(Deliver(i))
    /\ \A i \in Requests : WF_vars(UpstreamEnqueue(i))

UpstreamSpec == Init /\ [][UpstreamNext]_vars /\ UpstreamFairness

\* R-STOP-RETURNS for upstream: StopReturnsProp with upstream's leave.  Every
\* holder inside eventually leaves, and may pause again: pause() admits a
\* pause after a stop is asked, so holders that take turns keep the window
\* open and the stop waiting (D7).
UpstreamHoldersLeave == \A h \in Holders : WF_vars(UpstreamLeavePause(h))
UpstreamStopReturnsProp ==
    UpstreamHoldersLeave =>
        \A r \in Ranks :
            (localStatus[r] \in {FLUSH_AND_STOP, HARD_STOP}) ~> (phase[r] \in {"stopped", "dead"})
=============================================================================
