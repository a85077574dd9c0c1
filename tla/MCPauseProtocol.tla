-------------------------- MODULE MCPauseProtocol --------------------------
(* Bounds and witnesses for the models of PauseProtocol; each .cfg picks   *)
(* its constants from here.  See models.toml for the expected results.     *)
EXTENDS PauseProtocol, TLC

\* Holder-to-rank maps (a .cfg cannot write a function).
OneHolderOnRankOne == [h \in {1} |-> 1]
OneRankTwoHolders == [h \in {1, 2} |-> 1]
TwoRanksOneHolderEach == [h \in {1, 2} |-> h]
ThreeRanksOneHolderEach == [h \in {1, 2, 3} |-> h]


-----------------------------------------------------------------------------
(* Witnesses: properties that must FAIL, to show the models are not       *)
(* vacuous (as tlaplus/Examples keeps models that fail on purpose).        *)

\* A holder does get inside a pause.
NeverInsideWitness == ~AnyInside

\* A paused loop does resume.
NeverResumesWitness ==
    [][\A r \in Ranks : pc[r] = "window" => pc'[r] \in {"window", "dead"}]_vars

\* A stop does complete, cleanly (not through a fatal error).
NeverStopsWitness == \A r \in Ranks : ~(pc[r] = "stopped" /\ ~fatal[r])

\* A request is delivered, with no fatal error anywhere.
NeverDeliveredWitness ==
    \A i \in Requests : ~(req[i] = "delivered" /\ \A r \in Ranks : ~fatal[r])
=============================================================================
