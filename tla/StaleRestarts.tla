---------------------------- MODULE StaleRestarts ----------------------------
(***************************************************************************)
(* The staleness bound's restarts with windows unbounded (issue 40, point  *)
(* 1; R-STALENESS).  RequestVersions.tla checks the bound with the         *)
(* versions written out, and so with a bounded number of windows           *)
(* (MaxWindows): there the end of every restart chain is given by the      *)
(* bound, not proved.  Here one request and an unbounded number of         *)
(* windows, each setting a new version, abstracted to what the bound       *)
(* reads: how far behind the request's oldest token or KV is, counted up   *)
(* to MaxStaleness + 1 (past that, "stale" is all that matters), and how   *)
(* many forward steps it has had since its prompt, counted up to Tokens    *)
(* (then it is done).  The updates are the environment's and come as       *)
(* often as they like: after every forward step, or never.                 *)
(*                                                                         *)
(* With MaxRestarts restarts per request (max_stale_restarts) the request  *)
(* always ends: delivered with its tokens, or ended by the bound with a    *)
(* stale error once its restarts are spent.  Without the budget            *)
(* (StaleRestarts_unbounded, MaxRestarts = NONE) a request that needs more *)
(* steps than the updates leave it is restarted for ever: NothingLostProp  *)
(* fails, which is the starvation the audit found.                         *)
(***************************************************************************)
EXTENDS Naturals

CONSTANTS
    Tokens,        \* forward steps the request needs
    MaxStaleness,  \* the bound (max_staleness)
    MaxRestarts    \* the budget (max_stale_restarts); NONE: no budget
NONE == 99

VARIABLES
    st,        \* "waiting" (its prompt only: new, or restarted), "batch" (it has tokens and KV), "done" (output out)
    steps,     \* forward steps it had since its prompt (0..Tokens)
    behind,    \* versions its oldest token or KV is behind the one in force, up to MaxStaleness + 1
    restarted,  \* times the bound restarted it, up to MaxRestarts (with NONE, counted up to 1: only "some" matters)
    outputs,   \* terminal outputs
    stale,     \* its terminal output is the bound's error
    win,       \* a window is open: no forward step
    due        \* a window closed since the last forward step: the loop steps before another window opens

vars == <<st, steps, behind, restarted, outputs, stale, win, due>>

Capped(n, cap) == IF n > cap THEN cap ELSE n
Budget == IF MaxRestarts = NONE THEN 1 ELSE MaxRestarts

TypeOK ==
    /\ st \in {"waiting", "batch", "done"}
    /\ steps \in 0..Tokens
    /\ behind \in 0..(MaxStaleness + 1)
    /\ restarted \in 0..Budget
    /\ outputs \in 0..2
    /\ stale \in BOOLEAN
    /\ win \in BOOLEAN
    /\ due \in BOOLEAN

Init ==
    /\ st = "waiting" /\ steps = 0 /\ behind = 0 /\ restarted = 0 /\ outputs = 0 /\ stale = FALSE
    /\ win = FALSE /\ due = FALSE

\* A forward step: a waiting request is scheduled and prefilled with the weights in force (its first token), one in
\* the batch gets one more token; the last one ends the request with its tokens.
Step ==
    /\ st \in {"waiting", "batch"} /\ ~win
    /\ steps' = steps + 1
    /\ behind' = IF st = "waiting" THEN 0 ELSE behind
    /\ IF steps + 1 = Tokens
       THEN st' = "done" /\ outputs' = outputs + 1
       ELSE st' = "batch" /\ UNCHANGED outputs
    /\ due' = FALSE
    /\ UNCHANGED <<restarted, stale, win>>

\* A holder's window opens (PauseProtocol's OpenWindow), at the group step that ends an iteration: after a window
\* closed, the loop's next iteration takes its forward step first when it has work.
OpenWindow ==
    /\ ~win /\ (~due \/ st = "done")
    /\ win' = TRUE
    /\ UNCHANGED <<st, steps, behind, restarted, outputs, stale, due>>

\* ... and closes, with a new version set inside or not.  A request in the batch falls one more version behind; past
\* the bound it is restarted from its prompt while its restarted last, and ended with the bound's error after.
CloseWindow(updated) ==
    LET b == IF updated /\ st = "batch" THEN Capped(behind + 1, MaxStaleness + 1) ELSE behind
        isStale == st = "batch" /\ b > MaxStaleness
        again == isStale /\ (MaxRestarts = NONE \/ restarted < MaxRestarts) IN
    /\ win /\ win' = FALSE /\ due' = TRUE
    /\ IF ~isStale
       THEN behind' = b /\ UNCHANGED <<st, steps, restarted, outputs, stale>>
       ELSE IF again
       THEN /\ st' = "waiting" /\ steps' = 0 /\ behind' = 0
            /\ restarted' = Capped(restarted + 1, Budget)
            /\ UNCHANGED <<outputs, stale>>
       ELSE /\ st' = "done" /\ outputs' = outputs + 1 /\ stale' = TRUE
            /\ UNCHANGED <<steps, behind, restarted>>

Next == Step \/ OpenWindow \/ CloseWindow(TRUE) \/ CloseWindow(FALSE)

\* Fairness, each a claim about the code: the loop steps when it has work and no window is open, and a window
\* closes (PauseProtocol's WindowsCloseProp, holders leave).  That a forward step comes between two windows is the
\* loop's shape (LoopIteration._generation_loop_body: the forward step, then the group step where a window opens,
\* cbpause/integrations/iteration.py), which OpenWindow's guard on `due` states.  Nothing is fair for the holders:
\* they open windows and update as often as they like, after every forward step if they like.
Fairness == WF_vars(Step) /\ WF_vars(CloseWindow(TRUE) \/ CloseWindow(FALSE))

Spec == Init /\ [][Next]_vars /\ Fairness

\* At most one terminal output, and one once done.
NothingLostInv == outputs <= 1 /\ (st = "done" <=> outputs = 1)

\* Every request gets its terminal output: its tokens, or the bound's error once its restarted are spent.
NothingLostProp == <>(st = "done")

\* Witnesses: a request ended by the bound, and one delivered with its tokens after a restart.
NeverEndedStaleWitness == ~stale
NeverDeliveredAfterRestartWitness == ~(st = "done" /\ ~stale /\ restarted > 0)
=============================================================================
