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
    /\ Park(r)

\* pause(): only checks that the generation thread is alive.
UpstreamRequestPause(h) ==
    LET r == RankOf[h] IN
    /\ hs[h] = "idle"
    /\ Live(r)
    /\ hs' = [hs EXCEPT ![h] = "waiting"]
    /\ count' = [count EXCEPT ![r] = count[r] + 1]
    /\ UNCHANGED <<loopVars, groupVars, paused, requestVars, restarts>>

\* release_pause() by a thread that holds no pause: _drop_pause_request
\* runs anyway.
StrayRelease(r) ==
    /\ count' = [count EXCEPT ![r] = count[r] - 1]
    /\ paused' = IF count[r] - 1 = 0 THEN [paused EXCEPT ![r] = FALSE] ELSE paused
    /\ UNCHANGED <<loopVars, groupVars, hs, requestVars, restarts>>

UpstreamLoopAction(r) ==
    \/ Observe(r) \/ UpstreamOpenWindow(r) \/ CollectiveTimeout(r)
    \/ CloseWindow(r) \/ NoPause(r) \/ StartStep(r) \/ EndStep(r) \/ Idle(r)
    \/ ExitLoop(r)

UpstreamSystemNext ==
    \/ \E r \in Ranks : UpstreamLoopAction(r)
    \/ AllReduce \/ Barrier
    \/ \E h \in Holders : UpstreamRequestPause(h) \/ HolderWakes(h) \/ LeavePause(h)
    \/ \E i \in Requests : Submit(i) \/ Deliver(i)
    \/ Terminated

UpstreamNext == UpstreamSystemNext \/ EnvironmentNext \/ \E r \in Ranks : StrayRelease(r)

UpstreamFairness ==
    /\ \A r \in Ranks : WF_vars(UpstreamLoopAction(r))
    /\ WF_vars(AllReduce)
    /\ WF_vars(Barrier)
    /\ \A h \in Holders : SF_vars(HolderWakes(h))
    /\ \A i \in Requests : WF_vars(Deliver(i))

UpstreamSpec == Init /\ [][UpstreamNext]_vars /\ UpstreamFairness
=============================================================================
