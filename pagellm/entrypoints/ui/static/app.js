// The page: the key prompt, the live engine view and the playground.

import { installKeyDialog } from "./api.js";
import { LiveView } from "./live.js";
import { Playground } from "./playground.js";

installKeyDialog();
new Playground();
new LiveView().start();
