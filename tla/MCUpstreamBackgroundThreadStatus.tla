------------------ MODULE MCUpstreamBackgroundThreadStatus ------------------
(* Bounds for the models of upstream's protocol (expected failures).      *)
EXTENDS UpstreamBackgroundThreadStatus

OneHolderOnRankOne == [h \in {1} |-> 1]
=============================================================================
