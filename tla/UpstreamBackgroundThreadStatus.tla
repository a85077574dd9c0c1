------------------- MODULE UpstreamBackgroundThreadStatus -------------------
(***************************************************************************)
(* A faithful model of transformers 5.23.0's pause protocol                *)
(* (BackgroundThreadStatus in continuous_api.py, with                      *)
(* ContinuousBatchProcessor._update_tp_group_state), written as the        *)
(* differences from PauseProtocol so a reader sees exactly what we fix.    *)
(* Everything not redefined here is upstream's behaviour too: waiting      *)
(* holders wake on `_paused or loop_is_done` (EnterPause, PauseFails),     *)
(* the count drops in _drop_pause_request (Drop).  Not modelled: upstream *)
(* checks can_accept_new_requests() and enqueues in two steps (a request   *)
(* added as the loop exits could be lost); Submit is atomic in both.       *)
(*                                                                         *)
(* TLC is expected to FIND these defects here (see models.toml):           *)
(*   D1  ResumeProp: a request withdrawn after the loop read it leaves     *)
(*       pause_and_wait() parked with nobody to release it, for ever.      *)
(*   D2  CountsInv: a stray release_pause() drives the count to -1.        *)
(*   D3  ResumeProp, TP=2: a rank parked for a peer's pause, with no local *)
(*       holder, waits for ever.                                           *)
(***************************************************************************)
EXTENDS PauseProtocol


\* pause_and_wait(): set _paused and wait for it to go FALSE, whoever asked
\* and whether or not anybody is still pending.
UpstreamOpenWindow(r) ==
    /\ PauseDecided(r)
    /\ paused' = [paused EXCEPT ![r] = TRUE]
    /\ pc' = [pc EXCEPT ![r] = "window"]
    /\ UNCHANGED <<stop, tpStop, tpPause, obsStop, obsPause, fatal, count, hs,
                   req, out, restarts, crashes>>

\* pause(): only checks that the generation thread is alive.
UpstreamRequestPause(h) ==
    LET r == RankOf[h] IN
    /\ hs[h] = "idle"
    /\ Live(r)
    /\ hs' = [hs EXCEPT ![h] = "waiting"]
    /\ count' = [count EXCEPT ![r] = count[r] + 1]
    /\ UNCHANGED <<pc, stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   req, out, restarts, crashes>>

\* release_pause() by a thread that holds no pause: _drop_pause_request
\* runs anyway.  (Enabled while the count is not yet negative, which bounds
\* the model; one stray call is all D2 needs.)
StrayRelease(r) ==
    /\ "stray" \in Faults
    /\ count[r] >= 0
    /\ count' = [count EXCEPT ![r] = count[r] - 1]
    /\ paused' = IF count[r] - 1 = 0 THEN [paused EXCEPT ![r] = FALSE] ELSE paused
    /\ UNCHANGED <<pc, stop, tpStop, tpPause, obsStop, obsPause, fatal, hs,
                   req, out, restarts, crashes>>

UpstreamLoopAction(r) ==
    \/ Observe(r) \/ UpstreamOpenWindow(r) \/ CollectiveTimeout(r)
    \/ CloseWindow(r) \/ NoPause(r) \/ StartStep(r) \/ EndStep(r) \/ Idle(r)
    \/ ExitLoop(r)

UpstreamNext ==
    \/ \E r \in Ranks : UpstreamLoopAction(r)
    \/ AllReduce \/ Barrier
    \/ \E h \in Holders :
          UpstreamRequestPause(h) \/ HolderWakes(h) \/ LeavePause(h)
          \/ Interrupt(h) \/ PauseTimeout(h)
    \/ \E r \in Ranks : \E s \in {FLUSH_AND_STOP, HARD_STOP} : RequestStop(r, s)
    \/ \E r \in Ranks : FatalError(r) \/ Crash(r) \/ StrayRelease(r)
    \/ Restart
    \/ \E i \in Requests : Submit(i) \/ Deliver(i)
    \/ Terminated

UpstreamFairness ==
    /\ \A r \in Ranks : WF_vars(UpstreamLoopAction(r))
    /\ WF_vars(AllReduce)
    /\ WF_vars(Barrier)
    /\ \A h \in Holders : SF_vars(HolderWakes(h))
    /\ \A i \in Requests : WF_vars(Deliver(i))

UpstreamSpec == Init /\ [][UpstreamNext]_vars /\ UpstreamFairness
=============================================================================
